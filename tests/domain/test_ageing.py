"""Hardware ageing (medic/ageing.py): the score, its evidence, the trends, and the ranking found on
simulated history with planted lemons (tests/lemons.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from checkout import REPO_ROOT
from factories import T0, fault_event
from lemons import (
    LemonParams,
    by_incident_count,
    incidents_of,
    score,
    score_health,
    simulate_history,
)

from medic.ageing import (
    PastIncident,
    Reading,
    assess,
    bouts,
    readings_of,
    theil_sen,
    trends,
)
from medic.policy import load_policy

DAY = timedelta(days=1)
SINCE, UNTIL = T0, T0 + 30 * DAY


def past(
    id: str, day: float, node: str = "n1", gpus: tuple[int, ...] = (3,), job: str | None = "j1", **more: str
) -> PastIncident:
    jobs = (job,) if job else ()
    return PastIncident(id=id, node=node, opened_at=T0 + day * DAY, gpus=gpus, jobs=jobs, **more)


def reading(day: float, node: str = "n1", gpu: int = 3, **counters: int) -> Reading:
    return Reading(node, gpu, T0 + day * DAY, counters)


def test_theil_sen_is_the_median_slope_and_shrugs_off_one_outlier() -> None:
    line = [(float(x), 5.0 + 2 * x) for x in range(6)]
    assert theil_sen(line) == 2.0
    assert theil_sen([*line[:3], (3.0, 1_000.0), *line[4:]]) == 2.0


def test_a_trend_is_per_day_and_needs_a_day_of_readings() -> None:
    rising = [reading(d, ecc_corrected=100 + 40 * d, nvlink_crc=7) for d in (0, 1, 3, 6)]
    (ecc, crc) = trends(rising)
    assert (ecc.counter, ecc.per_day, ecc.readings, ecc.first, ecc.last) == (
        "ecc_corrected",
        40.0,
        4,
        100,
        340,
    )
    assert (crc.counter, crc.per_day) == ("nvlink_crc", 0.0)
    assert trends([reading(0, ecc_corrected=1), reading(0.5, ecc_corrected=900)]) == []  # half a day
    assert trends([reading(0, fan_rpm=1), reading(3, fan_rpm=9)]) == []  # not a counter we follow


def test_readings_are_whole_non_negative_counts_about_a_gpu() -> None:
    attrs = {"counters": {"ecc_corrected": 5, "nvlink_crc": -1, "row_remap_corrected": True, "x": "7"}}
    assert Reading.of("n1", 0, T0, attrs) == Reading("n1", 0, T0, {"ecc_corrected": 5})
    assert Reading.of("n1", None, T0, attrs) is None
    assert Reading.of("n1", 0, T0, {"counters": {"nvlink_crc": -1}}) is None
    assert Reading.of("n1", 0, T0, {"code": 79}) is None
    events = [fault_event(gpu=2, counters={"ecc_corrected": 9}), fault_event(gpu=2)]
    assert readings_of(events) == [Reading("gpu-017", 2, events[0].time, {"ecc_corrected": 9})]


def test_incidents_within_a_day_of_the_last_are_one_bout() -> None:
    times = [T0, T0 + timedelta(hours=5), T0 + timedelta(hours=20), T0 + 3 * DAY, T0 + 4 * DAY]
    assert bouts(times) == 3
    assert bouts([]) == 0


def test_the_score_adds_up_its_evidence() -> None:
    incidents = [
        past("a", 1, job="j1", owner="alice"),
        past("b", 5, job="j2", owner="alice"),
        past("c", 9, job="j3", owner="bob"),
    ]
    readings = [reading(d, ecc_corrected=10 + 15 * d) for d in (1, 5, 9)]
    health = assess(incidents, readings, SINCE, UNTIL)
    (node,) = health.nodes
    gpu, whole = node.gpus
    assert (node.rank, node.node, node.incidents, node.mtbi_hours) == (1, "n1", 3, 96.0)
    assert (gpu.gpu, gpu.incidents, gpu.jobs, gpu.owners, gpu.mtbi_hours) == (
        3,
        3,
        ["j1", "j2", "j3"],
        ["alice", "bob"],
        96.0,
    )
    assert [(e.points, e.why) for e in gpu.evidence] == [
        (2.0, "3 incidents on GPU 3 in 3 bouts a day or more apart, 96 h apart on average"),
        (2.0, "3 jobs: j1, j2, j3"),
        (0.5, "2 owners: alice, bob"),
        (1.5, "ecc_corrected rising 15/day (25 to 145; threshold 10/day)"),
    ]
    assert gpu.score == 6.0 == sum(e.points for e in gpu.evidence)
    # The node as a whole, at half weight: its incidents whatever GPU they named.
    assert (whole.gpu, whole.score, whole.trends) == (None, 2.25, [])
    assert node.score == gpu.score  # the worst of its GPUs and the whole node


def test_what_does_not_count() -> None:
    incidents = [
        past("app-1", 1, job="j1", classification="software"),  # the policy blamed the application
        past("app-2", 3, job="j2", classification="software"),
        past("early", -2, job="j3"),  # before the window
        past("hw", 5, job="j4", classification="hardware"),
        past("storm-1", 10, job="j5"),
        past("storm-2", 10.2, job="j5"),  # a burst within a day: one bout
    ]
    health = assess(incidents, [], SINCE, UNTIL)
    assert health.incidents == 3
    (gpu, _) = health.nodes[0].gpus
    assert (gpu.incidents, gpu.jobs) == (3, ["j4", "j5"])
    assert [e.why for e in gpu.evidence] == [
        "3 incidents on GPU 3 in 2 bouts a day or more apart, 62.4 h apart on average",
        "2 jobs: j4, j5",
    ]


def test_one_incident_and_flat_counters_are_no_evidence() -> None:
    health = assess([past("a", 1)], [reading(d, ecc_corrected=40) for d in (1, 9)], SINCE, UNTIL)
    assert (health.incidents, health.nodes_scored, health.nodes) == (1, 0, [])


def test_a_climbing_counter_ranks_a_gpu_before_it_fails() -> None:
    readings = [reading(d, node="n2", gpu=5, nvlink_crc=1_000 * d) for d in (2, 4, 8)]
    (node,) = assess([], readings, SINCE, UNTIL).nodes
    (gpu,) = node.gpus
    assert (node.node, gpu.gpu, gpu.incidents, gpu.score) == ("n2", 5, 0, 2.0)  # capped at 2 points
    assert gpu.evidence[0].why == "nvlink_crc rising 1000/day (2000 to 8000; threshold 100/day)"


def test_nodes_rank_by_score_and_top_keeps_the_first() -> None:
    incidents = [
        *(past(f"a{d}", d, node="worn", job=f"j{d}") for d in (1, 4, 8, 12)),
        *(past(f"b{d}", d, node="tired", job="j1") for d in (1, 4)),
        past("c", 2, node="fine"),
    ]
    health = assess(incidents, [], SINCE, UNTIL, top=1)
    assert (health.nodes_scored, [n.node for n in health.nodes]) == (2, ["worn"])
    assert [n.node for n in assess(incidents, [], SINCE, UNTIL).nodes] == ["worn", "tired"]


# -- validation: simulated history with planted lemons ----------------------------------------

SEED = 2


@pytest.fixture(scope="module")
def ranked() -> tuple:
    history = simulate_history(LemonParams(), SEED)
    incidents = incidents_of(history, load_policy(REPO_ROOT / "policies" / "default.yaml"))
    return history, incidents, assess(incidents, readings_of(history.events), history.start, history.end)


def test_the_ranking_finds_the_planted_lemons(ranked: tuple) -> None:
    history, incidents, health = ranked
    k = len(history.lemon_nodes)
    found = score_health(health, history, k)
    assert found.precision >= 0.75 and found.recall >= 0.75, found
    assert found.gpu_named == 1.0  # and names the lemon GPU of each node it found
    # A count of the hardware incidents per node, the simplest ranking, does worse.
    hardware = [i for i in incidents if i.blames_hardware]
    assert score(by_incident_count(hardware), history, k).precision < found.precision


def test_the_same_seed_gives_the_same_history() -> None:
    params = LemonParams(nodes=16, days=10)
    assert simulate_history(params, 7) == simulate_history(params, 7)
    assert simulate_history(params, 7).events != simulate_history(params, 8).events
