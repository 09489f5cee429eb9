"""The delivery pipeline for a batch of deliveries to one worker (issue 26): the core's steps
taken once for the batch, every feature's hooks still around each delivery.

Each delivery enters its features' ``admit`` and ``around_run`` contexts and loads its
engine; then, per engine, the features' ``around_batch`` contexts (the group lock: one
lease for the batch) and each delivery's ``around_call`` contexts; one
``Engine.process_batch`` call; one Redis round trip recording every outcome with the
features' writes and the pending ledger's settlements (each fence-checked); the outputs'
publish; then each delivery's contexts close with its own error, if any, and the features
judge it alone (:meth:`Pipeline.judge`): one failing event retries or is dead-lettered while
the others succeed. Deliveries that share a :meth:`Feature.batch_key` (an ordered key) run
in successive calls, each after the verdict of the one before: their order holds.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from wm.dataplane import tracing
from wm.dataplane.delivery import Delivery
from wm.dataplane.observe import notify
from wm.dataplane.pipeline import Feature, Pipeline, enter
from wm.dataplane.runtime import Runtime
from wm.dataplane.verdicts import DONE, Requeue, Verdict
from wm.dataplane.watchdog import OVERRUN_GRACE_S
from wm.engine import Engine
from wm.errors import Unavailable, WorkerExecutionError
from wm.events import CloudEvent, encode
from wm.state.connection import check_wait, queue_wait, redis_errors


class _Run:
    """One delivery of a batch on its way through the steps."""

    def __init__(self, delivery: Delivery) -> None:
        self.delivery = delivery
        self.outer = ExitStack()  # admit, around_run, running, its engine
        self.inner = ExitStack()  # around_call
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.produced: list[CloudEvent] = []
        #: (the outcome that counts, its outputs' routes when looked up with the record and
        #: their JSON when written for it)
        self.recorded: tuple[list[CloudEvent], list[Any] | None, list[str] | None] | None = None
        self.verdict: Verdict = DONE


class BatchPipeline(Pipeline):
    """:class:`Pipeline` with :meth:`run_batch`."""

    def __init__(self, features: Sequence[Feature]) -> None:
        super().__init__(features)
        self._batched = tuple(f for f in self.features if _overrides(f, "around_batch"))
        self._per_call = tuple(f for f in self._hooks.around_call if f not in self._batched)
        self._keyed = tuple(f for f in self.features if _overrides(f, "batch_key"))

    def run_batch(self, deliveries: Sequence[Delivery]) -> list[Verdict]:
        """Each delivery's verdict, in order (dead letters stored, features told)."""
        verdicts: dict[int, Verdict] = {}
        for rank, wave in enumerate(self.waves(deliveries)):
            for delivery in wave if rank else ():  # an earlier call may have recorded it
                delivery.forget_recorded()
            for run in self._wave(wave):
                verdicts[id(run.delivery)] = run.verdict
        return [verdicts[id(d)] for d in deliveries]

    def waves(self, deliveries: Sequence[Delivery]) -> list[list[Delivery]]:
        """The calls, in order: the n-th delivery of a key goes to the n-th call. Each
        delivery's outcome key is one of its keys: a repeated operation (one event twice, or
        one business key) runs after the first recorded its outcome, and republishes it."""
        waves: list[list[Delivery]] = []
        seen: dict[str, int] = {}
        for delivery in deliveries:
            keys = [k for f in self._keyed if (k := f.batch_key(delivery)) is not None]
            keys += [k for k in (delivery.outcome_key_or_none(),) if k is not None]
            rank = max((seen.get(k, 0) for k in keys), default=0)
            seen.update((k, rank + 1) for k in keys)
            if rank == len(waves):
                waves.append([])
            waves[rank].append(delivery)
        return waves

    def _wave(self, deliveries: Sequence[Delivery]) -> list[_Run]:
        runs = [_Run(d) for d in deliveries]
        by_engine: dict[int, list[_Run]] = {}
        for run in runs:
            if self._open(run):
                by_engine.setdefault(id(run.engine), []).append(run)
        for group in by_engine.values():
            self._call_group(group)
        for run in runs:
            run.verdict = self._verdict(run.delivery, _close(run.outer, run.error))
        return runs

    def _open(self, run: _Run) -> bool:
        """Enter the delivery's outer contexts and load its engine; False when it needs no
        call (its outcome was recorded, republished) or failed (``run.error``)."""
        delivery, stack = run.delivery, run.outer
        try:
            for feature in self._hooks.admit:
                enter(stack, feature.admit(delivery))
            recorded = delivery.recorded_outcome()
            if recorded is not None:
                delivery.republish(recorded)
                return False
            for feature in self._hooks.around_run:
                enter(stack, feature.around_run(delivery))
            stack.enter_context(delivery.running())
            engine, temporary = delivery.load_engine()
            if temporary:
                stack.callback(engine.close)
            run.engine = engine
            return True
        except Exception as exc:
            run.error = exc
            return False

    def _call_group(self, group: list[_Run]) -> None:
        """The runs of one engine: the batch contexts, one call, one record, the publish."""
        engine = group[0].engine
        assert engine is not None
        deliveries = [run.delivery for run in group]
        try:
            with ExitStack() as batch:
                for feature in self._batched:
                    enter(batch, feature.around_batch(deliveries, engine))
                live = [run for run in group if self._enter_call(run, engine)]
                self._execute(live, engine)
                self._record(live)
                self._publish(live)
                for run in group:
                    run.error = _close(run.inner, run.error)
        except Exception as exc:  # a batch context refused or failed: every delivery with it
            for run in group:
                run.error = _close(run.inner, run.error or exc) or exc

    def _enter_call(self, run: _Run, engine: Engine) -> bool:
        delivery = run.delivery
        try:
            for feature in self._per_call:
                enter(run.inner, feature.around_call(delivery, engine))
            if delivery.recorded is not None:  # recorded meanwhile (read under the lock)
                delivery.republish(delivery.recorded)
                return False
            return True
        except Exception as exc:
            run.error = exc
            return False

    def _execute(self, live: list[_Run], engine: Engine) -> None:
        """One engine call for ``live``; each run gets its outputs or its error."""
        if not live:
            return
        first = live[0].delivery
        started = time.monotonic()
        try:
            with tracing.step("engine call"), self._watched(live, engine, started):
                results = engine.process_batch(
                    [run.delivery.event for run in live], first.timeout_s
                )
            if len(results) != len(live):
                raise WorkerExecutionError(
                    f"the engine returned {len(results)} results for a batch of {len(live)}"
                )
        except Exception as exc:  # the call itself failed: every event with it
            results = [exc] * len(live)
        finally:
            each_s = (time.monotonic() - started) / len(live)
            for run in live:
                notify("engine", run.delivery.meta, each_s)
        for run, result in zip(live, results, strict=True):
            if isinstance(result, Exception):
                run.error = result
            else:
                run.produced = result

    def _watched(
        self, live: list[_Run], engine: Engine, started: float
    ) -> AbstractContextManager[object]:
        """A call the engine cannot stop is watched (``Delivery.watched``), its limit the
        events' limits together; past it, a pool process ends unsettled: every message of
        the batch comes back (each then runs alone, as a redelivery)."""
        first = live[0].delivery
        if engine.stops_calls():
            return contextlib.nullcontext()
        deadline = started + first.timeout_s * len(live) + OVERRUN_GRACE_S
        what = f"the batch call of worker {first.meta.id} on {len(live)} events"
        overrun = None if first.on_overrun is None else _nothing
        return first.rt.watchdog.watch(deadline, what, overrun)

    def _record(self, live: list[_Run]) -> None:
        """Every outcome recorded, fence-checked, with the features' writes and the
        ledger's settlement: one round trip."""
        runs = [run for run in live if run.error is None]
        if not runs:
            return
        rt = runs[0].delivery.rt
        pipe = rt.outcomes.redis.pipeline(transaction=False)
        queued = [q for run in runs if (q := self._queue_record(run, pipe)) is not None]
        if not queued:
            return
        last = queued[-1][0].delivery  # a batch is one worker's: its outcomes share a slot
        waited = queue_wait(pipe, rt.settings, rt.outcomes.key(last.meta.id, last.operation))
        try:
            with redis_errors(rt.settings):
                replies = pipe.execute()
            if waited:
                check_wait(rt.settings, replies[-1], "a batch's outcomes")
        except Exception as exc:
            for run, *_ in queued:
                run.error = exc
            return
        for run, outputs, texts, fence, at in queued:
            try:
                run.recorded = _recorded(
                    rt, replies[at : at + 1 + len(outputs)], outputs, texts, fence
                )
            except Exception as exc:
                run.error = exc

    def _queue_record(
        self, run: _Run, pipe: Any
    ) -> tuple[_Run, list[CloudEvent], list[str], Any, int] | None:
        """Queue the run's record (its index among the replies), or None when its outputs
        are refused (``run.error``)."""
        delivery = run.delivery
        rt = delivery.rt
        try:
            outputs = delivery.stamp(run.produced)
            fence = None if delivery.lease is None else rt.locks.write_fence(delivery.lease)
            texts = [encode(e) for e in outputs]  # once, for the record and the publishes
            body = rt.outcomes.encoded(outputs, texts)
        except Exception as exc:
            run.error = exc
            return None
        at = len(pipe)
        meta = delivery.meta
        rt.outcomes.queue_record(
            pipe, meta.id, delivery.operation, body, delivery.settlement(), fence
        )
        rt.outputs.lookups(outputs)(pipe)
        self._recorders(delivery)(pipe)
        return run, outputs, texts, fence, at

    def _publish(self, live: list[_Run]) -> None:
        for run in live:
            if run.error is not None or run.recorded is None:
                continue
            recorded, routes, texts = run.recorded
            try:
                run.delivery.publish(recorded, routes, settled=True, texts=texts)
                run.delivery.published(recorded, run.produced)
            except Exception as exc:  # recorded: its redelivery publishes it
                run.error = exc

    def _verdict(self, delivery: Delivery, error: BaseException | None) -> Verdict:
        """As :meth:`Pipeline.run` judges an attempt; the platform out of reach: requeued."""
        try:
            if error is None:
                verdict: Verdict = DONE
            elif isinstance(error, Verdict):
                verdict = error
            elif isinstance(error, Unavailable):
                raise error
            elif isinstance(error, Exception):
                verdict = self.judge(delivery, error)
            else:
                raise error
            return self._settle(delivery, verdict)
        except Unavailable as exc:
            return Requeue(f"{type(exc).__name__}: {exc}", pause=True)


def _recorded(
    rt: Runtime, replies: list[Any], outputs: list[CloudEvent], texts: list[str], fence: Any
) -> tuple[list[CloudEvent], list[Any] | None, list[str] | None]:
    """A run's record (its reply, then its outputs' route lookups): the outcome that counts
    and, when it is this run's, its outputs' routes and JSON."""
    recorded = rt.outcomes.recorded(replies[0], outputs, fence)
    if recorded is not outputs:  # an earlier run's: looked up and written again
        return recorded, None, None
    return recorded, [rt.bus.parse_routes(flat) for flat in replies[1:]], texts


def _overrides(feature: Feature, hook: str) -> bool:
    return getattr(type(feature), hook) is not getattr(Feature, hook)


def _close(stack: ExitStack, error: BaseException | None) -> BaseException | None:
    """Leave ``stack`` as ``error`` leaves it; returns the error that comes out (None)."""
    try:
        if error is None:
            stack.close()
        elif stack.__exit__(type(error), error, error.__traceback__):
            return None
        else:
            return error
    except Exception as exc:
        return exc
    return None


def _nothing() -> None:
    """The overrun of a batch settles nothing: the process ends, its messages come back."""
