/*
 * A stand-in for NVIDIA's libnvidia-ml.so.1 so that nvidia-ml-py's real ctypes code path can be
 * driven on a machine without a GPU. It exports the symbols integrations/nvml.py reaches, with
 * NVML's C signatures and return codes, and answers from a state file whose path is in
 * $MEDIC_NVML_SHIM_STATE. The file is read again whenever it changes (a test replaces it
 * atomically), so a test can inject an ECC jump, an XID, a lost GPU or a failing driver between
 * two polls of a running process.
 *
 * State file: one directive per line, `#` starts a comment.
 *   count N                    GPUs nvmlDeviceGetCount reports (default 8)
 *   driver VERSION             nvmlSystemGetDriverVersion
 *   init_rc RC                 what nvmlInitWithFlags / nvmlInit_v2 return (9: driver not loaded)
 *   call_rc RC                 forced on every call but init, shutdown and nvmlErrorString
 *   init_sleep_ms MS           nvmlInitWithFlags takes this long first (a driver slow to answer)
 *   rc FUNCTION RC [GPU]       forced on one function (for one GPU only when GPU is given)
 *   gpu I KEY VALUE            per-GPU value; KEY is one of the names in `struct gpu` below
 *   xid GPU CODE               a pending XID critical-error event; each line is delivered once
 *
 * When $MEDIC_NVML_SHIM_CALLS names a file, the number of NVML calls made is written there as the
 * process exits (the agent's benchmark reports it).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_GPUS 64
#define MAX_RC 64
#define MAX_XIDS 1024

#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_UNKNOWN 999
#define NVML_EVENT_XID 0x8ULL

typedef int nvmlReturn_t;

struct gpu {
    int lost;
    unsigned long long sbe_volatile, dbe_volatile, sbe_aggregate, dbe_aggregate;
    unsigned retired_sbe, retired_dbe, retired_pending;
    unsigned remap_corrected, remap_uncorrected, remap_pending, remap_failure;
    unsigned temp, power_mw;
    unsigned long long reasons;
    unsigned pcie_gen, pcie_width, pcie_max_gen, pcie_max_width;
    unsigned nvlinks;
    unsigned persistence;
    unsigned long long nvlink_down;
};

struct rc_override {
    char function[96];
    int gpu; /* -1: every GPU */
    nvmlReturn_t rc;
};

struct xid {
    unsigned gpu;
    unsigned long long code;
};

/* The handle NVML hands out is an opaque pointer; ours points at the GPU's slot here. */
struct device {
    unsigned index;
};

static struct device devices[MAX_GPUS];
static struct gpu gpus[MAX_GPUS];
static struct rc_override overrides[MAX_RC];
static struct xid xids[MAX_XIDS];
static unsigned gpu_count, n_overrides, n_xids, xids_delivered;
static nvmlReturn_t init_rc, call_rc;
static unsigned init_sleep_ms;
static char driver[80];
static struct stat loaded;
static int have_loaded;
static unsigned long long calls;

__attribute__((destructor)) static void report_calls(void) {
    const char *path = getenv("MEDIC_NVML_SHIM_CALLS");
    FILE *f = path ? fopen(path, "w") : NULL;
    if (f) {
        fprintf(f, "%llu\n", calls);
        fclose(f);
    }
}

static void defaults(void) {
    gpu_count = 8;
    n_overrides = n_xids = 0;
    init_rc = call_rc = NVML_SUCCESS;
    init_sleep_ms = 0;
    snprintf(driver, sizeof driver, "550.54.15");
    for (unsigned i = 0; i < MAX_GPUS; i++) {
        memset(&gpus[i], 0, sizeof gpus[i]);
        gpus[i].temp = 45;
        gpus[i].power_mw = 310000;
        gpus[i].reasons = 0x1; /* GpuIdle */
        gpus[i].pcie_gen = gpus[i].pcie_max_gen = 5;
        gpus[i].pcie_width = gpus[i].pcie_max_width = 16;
        gpus[i].nvlinks = 18;
        gpus[i].persistence = 1; /* enabled */
        devices[i].index = i;
    }
}

static int set_gpu_value(struct gpu *g, const char *key, unsigned long long v) {
    struct { const char *name; void *field; int wide; } keys[] = {
        {"lost", &g->lost, 0},
        {"sbe_volatile", &g->sbe_volatile, 1},
        {"dbe_volatile", &g->dbe_volatile, 1},
        {"sbe_aggregate", &g->sbe_aggregate, 1},
        {"dbe_aggregate", &g->dbe_aggregate, 1},
        {"retired_sbe", &g->retired_sbe, 0},
        {"retired_dbe", &g->retired_dbe, 0},
        {"retired_pending", &g->retired_pending, 0},
        {"remap_corrected", &g->remap_corrected, 0},
        {"remap_uncorrected", &g->remap_uncorrected, 0},
        {"remap_pending", &g->remap_pending, 0},
        {"remap_failure", &g->remap_failure, 0},
        {"temp", &g->temp, 0},
        {"power_mw", &g->power_mw, 0},
        {"reasons", &g->reasons, 1},
        {"pcie_gen", &g->pcie_gen, 0},
        {"pcie_width", &g->pcie_width, 0},
        {"pcie_max_gen", &g->pcie_max_gen, 0},
        {"pcie_max_width", &g->pcie_max_width, 0},
        {"nvlinks", &g->nvlinks, 0},
        {"persistence", &g->persistence, 0},
        {"nvlink_down", &g->nvlink_down, 1},
    };
    for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
        if (strcmp(keys[k].name, key) == 0) {
            if (keys[k].wide)
                *(unsigned long long *)keys[k].field = v;
            else
                *(unsigned *)keys[k].field = (unsigned)v;
            return 0;
        }
    }
    fprintf(stderr, "nvml shim: unknown gpu key %s\n", key);
    return -1;
}

static void parse(FILE *f) {
    char line[512], word[96], key[96];
    unsigned long long a, b;
    int gpu;
    defaults();
    while (fgets(line, sizeof line, f)) {
        char *hash = strchr(line, '#');
        if (hash)
            *hash = '\0';
        if (sscanf(line, "count %llu", &a) == 1)
            gpu_count = a > MAX_GPUS ? MAX_GPUS : (unsigned)a;
        else if (sscanf(line, "driver %79s", driver) == 1)
            ;
        else if (sscanf(line, "init_rc %llu", &a) == 1)
            init_rc = (nvmlReturn_t)a;
        else if (sscanf(line, "init_sleep_ms %llu", &a) == 1)
            init_sleep_ms = (unsigned)a;
        else if (sscanf(line, "call_rc %llu", &a) == 1)
            call_rc = (nvmlReturn_t)a;
        else if (sscanf(line, "gpu %d %95s %llu", &gpu, key, &a) == 3 && gpu >= 0 && gpu < MAX_GPUS)
            set_gpu_value(&gpus[gpu], key, a);
        else if (sscanf(line, "xid %llu %llu", &a, &b) == 2 && n_xids < MAX_XIDS)
            xids[n_xids++] = (struct xid){(unsigned)a, b};
        else if (n_overrides < MAX_RC) {
            int n = sscanf(line, "rc %95s %llu %d", word, &a, &gpu);
            if (n >= 2) {
                struct rc_override *o = &overrides[n_overrides++];
                snprintf(o->function, sizeof o->function, "%s", word);
                o->rc = (nvmlReturn_t)a;
                o->gpu = n == 3 ? gpu : -1;
            }
        }
    }
}

/* Read the state file again if it was replaced or changed since the last call. */
static void refresh(void) {
    const char *path = getenv("MEDIC_NVML_SHIM_STATE");
    struct stat now;
    if (!path || stat(path, &now) != 0) {
        if (!have_loaded)
            defaults();
        have_loaded = 1;
        return;
    }
    if (have_loaded && now.st_ino == loaded.st_ino && now.st_mtim.tv_sec == loaded.st_mtim.tv_sec &&
        now.st_mtim.tv_nsec == loaded.st_mtim.tv_nsec && now.st_size == loaded.st_size)
        return;
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    parse(f);
    fclose(f);
    loaded = now;
    have_loaded = 1;
    if (xids_delivered > n_xids)
        xids_delivered = n_xids; /* the test started a fresh list */
}

static nvmlReturn_t forced(const char *function, int gpu) {
    for (unsigned i = 0; i < n_overrides; i++)
        if (strcmp(overrides[i].function, function) == 0 && (overrides[i].gpu < 0 || overrides[i].gpu == gpu))
            return overrides[i].rc;
    return NVML_SUCCESS;
}

/* The checks every call makes first: the forced codes, then the device's own state. */
static nvmlReturn_t enter(const char *function, struct device *d) {
    calls++;
    refresh();
    if (call_rc != NVML_SUCCESS)
        return call_rc;
    int gpu = d ? (int)d->index : -1;
    nvmlReturn_t rc = forced(function, gpu);
    if (rc != NVML_SUCCESS)
        return rc;
    if (d) {
        if (d < devices || d >= devices + MAX_GPUS || d->index >= gpu_count)
            return NVML_ERROR_INVALID_ARGUMENT;
        if (gpus[d->index].lost)
            return NVML_ERROR_GPU_IS_LOST;
    }
    return NVML_SUCCESS;
}

#define ENTER(d)                                         \
    do {                                                 \
        nvmlReturn_t rc_ = enter(__func__, (d));         \
        if (rc_ != NVML_SUCCESS)                         \
            return rc_;                                  \
    } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned flags) {
    (void)flags;
    calls++;
    refresh();
    if (init_sleep_ms)
        usleep(init_sleep_ms * 1000U);
    return init_rc;
}

nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

nvmlReturn_t nvmlShutdown(void) { return NVML_SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t rc) {
    switch (rc) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case 9: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    default: return "Unknown Error";
    }
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned length) {
    ENTER(NULL);
    snprintf(version, length, "%s", driver);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned *count) {
    ENTER(NULL);
    *count = gpu_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned index, struct device **device) {
    ENTER(NULL);
    if (index >= gpu_count)
        return NVML_ERROR_INVALID_ARGUMENT;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(struct device *d, char *name, unsigned length) {
    ENTER(d);
    snprintf(name, length, "NVIDIA H100 80GB HBM3");
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(struct device *d, char *uuid, unsigned length) {
    ENTER(d);
    snprintf(uuid, length, "GPU-5ba7e1c0-0000-4000-8000-%012x", d->index);
    return NVML_SUCCESS;
}

/* The bus number of GPU i; the agent's tests write kernel-log lines with the same formula. */
static unsigned bus_of(unsigned index) { return 0x18 + 0x10 * index; }

typedef struct {
    char busIdLegacy[16];
    unsigned domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

nvmlReturn_t nvmlDeviceGetPciInfo_v3(struct device *d, nvmlPciInfo_t *pci) {
    ENTER(d);
    memset(pci, 0, sizeof *pci);
    pci->bus = bus_of(d->index);
    pci->pciDeviceId = 0x233010de;
    snprintf(pci->busId, sizeof pci->busId, "00000000:%02X:00.0", pci->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "0000:%02X:00.0", pci->bus);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(struct device *d, int errorType, int counterType,
                                         unsigned long long *count) {
    ENTER(d);
    struct gpu *g = &gpus[d->index];
    if (errorType == 0)
        *count = counterType == 0 ? g->sbe_volatile : g->sbe_aggregate;
    else
        *count = counterType == 0 ? g->dbe_volatile : g->dbe_aggregate;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(struct device *d, int cause, unsigned *count,
                                       unsigned long long *addresses) {
    ENTER(d);
    unsigned have = cause == 0 ? gpus[d->index].retired_sbe : gpus[d->index].retired_dbe;
    if (addresses == NULL || *count < have) {
        *count = have;
        return have ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned i = 0; i < have; i++)
        addresses[i] = 0x1000ULL * (i + 1);
    *count = have;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(struct device *d, int *pending) {
    ENTER(d);
    *pending = (int)gpus[d->index].retired_pending;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(struct device *d, unsigned *corrected, unsigned *uncorrected,
                                       unsigned *pending, unsigned *failure) {
    ENTER(d);
    struct gpu *g = &gpus[d->index];
    *corrected = g->remap_corrected;
    *uncorrected = g->remap_uncorrected;
    *pending = g->remap_pending;
    *failure = g->remap_failure;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTemperature(struct device *d, int sensor, unsigned *temp) {
    ENTER(d);
    if (sensor != 0)
        return NVML_ERROR_INVALID_ARGUMENT;
    *temp = gpus[d->index].temp;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(struct device *d, unsigned long long *reasons) {
    ENTER(d);
    *reasons = gpus[d->index].reasons;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(struct device *d, unsigned long long *reasons) {
    ENTER(d);
    *reasons = gpus[d->index].reasons;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(struct device *d, unsigned *milliwatts) {
    ENTER(d);
    *milliwatts = gpus[d->index].power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPersistenceMode(struct device *d, int *mode) {
    ENTER(d);
    *mode = (int)gpus[d->index].persistence;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(struct device *d, unsigned *v) {
    ENTER(d);
    *v = gpus[d->index].pcie_gen;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(struct device *d, unsigned *v) {
    ENTER(d);
    *v = gpus[d->index].pcie_width;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(struct device *d, unsigned *v) {
    ENTER(d);
    *v = gpus[d->index].pcie_max_gen;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(struct device *d, unsigned *v) {
    ENTER(d);
    *v = gpus[d->index].pcie_max_width;
    return NVML_SUCCESS;
}

/* Like NVML on a board with N links: links past N are an invalid argument, and a board with
 * no NVLink at all (nvlinks 0) answers "not supported". */
nvmlReturn_t nvmlDeviceGetNvLinkState(struct device *d, unsigned link, int *active) {
    ENTER(d);
    struct gpu *g = &gpus[d->index];
    if (g->nvlinks == 0)
        return NVML_ERROR_NOT_SUPPORTED;
    if (link >= g->nvlinks)
        return NVML_ERROR_INVALID_ARGUMENT;
    *active = (g->nvlink_down >> link) & 1ULL ? 0 : 1;
    return NVML_SUCCESS;
}

typedef struct {
    struct device *device;
    unsigned long long eventType, eventData;
    unsigned gpuInstanceId, computeInstanceId;
} nvmlEventData_t;

struct event_set {
    unsigned long long registered[MAX_GPUS];
};

nvmlReturn_t nvmlEventSetCreate(struct event_set **set) {
    ENTER(NULL);
    *set = calloc(1, sizeof **set);
    return *set ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

nvmlReturn_t nvmlEventSetFree(struct event_set *set) {
    free(set);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceRegisterEvents(struct device *d, unsigned long long types, struct event_set *set) {
    ENTER(d);
    set->registered[d->index] |= types;
    return NVML_SUCCESS;
}

/* Never sleeps: a pending XID for a registered GPU, else an immediate timeout. */
nvmlReturn_t nvmlEventSetWait_v2(struct event_set *set, nvmlEventData_t *data, unsigned timeout_ms) {
    (void)timeout_ms;
    ENTER(NULL);
    while (xids_delivered < n_xids) {
        struct xid x = xids[xids_delivered++];
        if (x.gpu < gpu_count && (set->registered[x.gpu] & NVML_EVENT_XID)) {
            memset(data, 0, sizeof *data);
            data->device = &devices[x.gpu];
            data->eventType = NVML_EVENT_XID;
            data->eventData = x.code;
            return NVML_SUCCESS;
        }
    }
    return NVML_ERROR_TIMEOUT;
}
