"""The torch side of a rank's profile: the hooks decide when (medic_hooks.profile_wanted), this takes it.

    with StepProfiler(hooks, device) as profiler:
        for step in ...:
            profiler.before(step)
            ...                       # the step
            hooks.step(step, loss, seconds)
            profiler.after(step)

When the hooks ask, the next steps run under torch.profiler (CPU activity, and CUDA's on a GPU, with
operator shapes and Python functions), each marked `ProfilerStep#<step>`, and the trace is written as
Chrome trace JSON where the request says; `hooks.profiled` then reports it (docs/culprit.md).
Nothing is imported or started otherwise.
"""

from __future__ import annotations

import logging
import os
from types import TracebackType

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from medic.training.medic_hooks import MedicHooks, ProfileRequest

log = logging.getLogger("medic_profiling")


class StepProfiler:
    def __init__(self, hooks: MedicHooks, device: torch.device) -> None:
        self.hooks = hooks
        self.device = device
        self._request: ProfileRequest | None = None
        self._profile: profile | None = None
        self._first_step = self._last_step = 0
        self._marker: record_function | None = None

    def before(self, step: int) -> None:
        """Call at the start of each step: starts a profile the hooks ask for."""
        if self._request is None:
            request = self.hooks.profile_wanted()
            if request is None:
                return
            self._start(request, step)
        if self._profile is not None:
            self._marker = record_function(f"ProfilerStep#{step}")
            self._marker.__enter__()

    def after(self, step: int) -> None:
        """Call at the end of each step, after `hooks.step`: ends the profile after its last step."""
        if self._marker is not None:
            self._marker.__exit__(None, None, None)
            self._marker = None
        self._last_step = step
        if self._request is not None and step - self._first_step + 1 >= self._request.steps:
            self._finish()

    def __enter__(self) -> StepProfiler:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        # Training ran out of steps mid-profile: what was taken is still worth having. A failing
        # rank is left alone: stopping a profiler in a broken process could only add to its trouble.
        if kind is None and self._request is not None:
            self._finish()

    def _start(self, request: ProfileRequest, step: int) -> None:
        self._request, self._first_step = request, step
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        try:
            # Shapes and Python stacks: what lets a diff against a healthy peer tell the same operator
            # slower from more of them, and name the Python function a rank spends its time in
            # (medic/profile_diff.py). They cost the profiled steps only.
            self._profile = profile(activities=activities, record_shapes=True, with_stack=True)
            self._profile.start()
        except Exception:  # another profiler may be running: the job comes first
            log.exception("could not start a profile of step %s", step)
            self._profile = None

    def _finish(self) -> None:
        request, running = self._request, self._profile
        assert request is not None
        self._request = self._profile = None
        if running is not None:
            try:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)  # the last step's kernels belong in the trace
                running.stop()
                # Written aside, then renamed: a reader never sees half a trace.
                partial = request.path.with_name(request.path.name + ".part")
                running.export_chrome_trace(str(partial))
                os.replace(partial, request.path)
            except Exception:
                log.exception("could not write the profile %s", request.path)
        self.hooks.profiled(request, self._first_step, self._last_step)
