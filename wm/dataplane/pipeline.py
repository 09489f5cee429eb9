"""The delivery pipeline: a small core and the features around it (DESIGN.md §2, §5.3).

The core is decode → recorded outcome? → engine → record → publish (``wm.dataplane.tasks``
decodes; :class:`Pipeline` and :class:`~wm.dataplane.delivery.Delivery` do the rest). Every
other concern is a :class:`Feature` in ``wm.dataplane.features``, whose ordered list is the
only place that names them; the core calls their hooks and never an ``if`` of its own for
one of them (STYLE.md habit 16). A feature's hooks, each optional:

- :meth:`Feature.facts`: Redis keys read with the worker's facts, in the delivery's first
  round trip (``Delivery.facts``);
- :meth:`Feature.admit`: a context around the whole attempt; it may refuse, defer or wait by
  raising (a :class:`~wm.dataplane.verdicts.Verdict`, or an error for the features to
  judge), and sees a failure leave it as an exception;
- :meth:`Feature.around_run`: a context around the engine's part (loading, call, record,
  publish), entered only when no outcome is recorded yet; it may give an engine that makes
  the call instead of the one loaded here (session affinity: another process's);
- :meth:`Feature.around_call`: a context around the call, once the engine is loaded; it may
  find the outcome recorded meanwhile (``Delivery.recorded``);
- :meth:`Feature.recording`: its writes, added to the outcome's record (one round trip);
- :meth:`Feature.failed`: what a failed attempt means: a :class:`Verdict`, or None to let
  the next feature judge;
- :meth:`Feature.ended`: told the attempt's verdict (``DONE`` for a success).

A context hook with nothing to do for a delivery returns :data:`NOTHING`, which the
pipeline does not enter: most features apply to few workers, and a delivery pays for the
contexts of those that apply to it only. A check with nothing to undo after raises from the
hook itself and returns :data:`NOTHING`.

In a batch (``wm.dataplane.batching``) two more: :meth:`Feature.around_batch`, once around
the batch's one engine call instead of ``around_call`` for each delivery, and
:meth:`Feature.batch_key`, which keeps deliveries of one key out of the same call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, ClassVar

from wm.dataplane.delivery import Delivery
from wm.dataplane.verdicts import DONE, Park, Verdict
from wm.engine import Engine
from wm.errors import Unavailable
from wm.state.connection import StatePipeline

#: A context hook's answer when it has nothing to do for the delivery: not entered.
NOTHING: AbstractContextManager[Any] = contextlib.nullcontext()


def enter(stack: ExitStack, context: AbstractContextManager[Any]) -> Any:
    """``context`` entered on ``stack`` (what it gives), unless it is :data:`NOTHING`."""
    return None if context is NOTHING else stack.enter_context(context)


class Feature:
    """One concern around the core. Subclasses override the hooks they need."""

    #: The :class:`~wm.workersettings.WorkerSettings` fields this feature owns.
    owns: ClassVar[tuple[str, ...]] = ()

    def facts(self, worker_id: str) -> Sequence[str]:
        return ()

    def admit(self, delivery: Delivery) -> AbstractContextManager[object]:
        return NOTHING

    def around_run(self, delivery: Delivery) -> AbstractContextManager[object]:
        return NOTHING

    def around_call(self, delivery: Delivery, engine: Engine) -> AbstractContextManager[object]:
        return NOTHING

    def recording(self, delivery: Delivery, pipe: StatePipeline) -> None:
        return None

    def awaits_record(self, delivery: Delivery) -> bool:
        """Whether what this feature does once the delivery is done assumes its outcome was
        written: then the record's reply is waited for even without outputs
        (``wm.state.unawaited``)."""
        return False

    def failed(self, delivery: Delivery, error: Exception) -> Verdict | None:
        return None

    def ended(self, delivery: Delivery, verdict: Verdict) -> None:
        return None

    def around_batch(
        self, deliveries: Sequence[Delivery], engine: Engine
    ) -> AbstractContextManager[object]:
        """Overridden: called once per batch call instead of :meth:`around_call`."""
        return NOTHING

    def batch_key(self, delivery: Delivery) -> str | None:
        """Deliveries with one key run in separate calls of a batch, in their order."""
        return None


@dataclass(frozen=True)
class _Hooks:
    """The features that override each hook, in the list's order."""

    facts: tuple[Feature, ...]
    admit: tuple[Feature, ...]
    around_run: tuple[Feature, ...]
    around_call: tuple[Feature, ...]
    recording: tuple[Feature, ...]
    awaits_record: tuple[Feature, ...]
    failed: tuple[Feature, ...]
    ended: tuple[Feature, ...]

    @classmethod
    def of(cls, features: Sequence[Feature]) -> _Hooks:
        def overriding(name: str) -> tuple[Feature, ...]:
            base = getattr(Feature, name)
            return tuple(f for f in features if getattr(type(f), name) is not base)

        return cls(*(overriding(name) for name in cls.__dataclass_fields__))


class Pipeline:
    """Runs one attempt through the core with ``features`` around it, in their order."""

    def __init__(self, features: Sequence[Feature]) -> None:
        self.features = tuple(features)
        self._hooks = _Hooks.of(self.features)

    def fact_keys(self, worker_id: str) -> list[str]:
        return [key for f in self._hooks.facts for key in f.facts(worker_id)]

    def run(self, delivery: Delivery) -> Verdict:
        """The attempt's verdict; a dead letter is stored before the features hear of it.
        Platform errors (broker, database out of reach) propagate: nothing was decided."""
        return self._settle(delivery, self._attempt(delivery))

    def fail(self, delivery: Delivery, error: Exception) -> Verdict:
        """The verdict on an attempt whose call was taken over by the watchdog
        (``wm.dataplane.watchdog``), judged from its thread as ``run`` judges a failure."""
        return self._settle(delivery, self.judge(delivery, error))

    def _settle(self, delivery: Delivery, verdict: Verdict) -> Verdict:
        if isinstance(verdict, Park):
            delivery.rt.dead_letters.park(verdict.failure)
        for feature in self._hooks.ended:
            feature.ended(delivery, verdict)
        return verdict

    def _attempt(self, delivery: Delivery) -> Verdict:
        """Run the core inside the features' contexts, which see any failure as it leaves."""
        try:
            with ExitStack() as stack:
                for feature in self._hooks.admit:
                    enter(stack, feature.admit(delivery))
                self._core(delivery)
        except Unavailable:  # the platform itself: back to the queue, judged by no feature
            raise
        except Verdict as verdict:  # a feature decided (a refusal, a wait)
            return verdict
        except Exception as error:  # every failure is judged by the features
            return self.judge(delivery, error)
        return DONE

    def judge(self, delivery: Delivery, error: Exception) -> Verdict:
        for feature in self._hooks.failed:
            verdict = feature.failed(delivery, error)
            if verdict is not None:
                return verdict
        return Park(delivery.failure(error))  # judged by none: parked, never lost

    def _core(self, delivery: Delivery) -> None:
        recorded = delivery.recorded_outcome()
        if recorded is not None:
            delivery.republish(recorded)
            return
        with ExitStack() as stack:
            instead = None
            for feature in self._hooks.around_run:
                entered = enter(stack, feature.around_run(delivery))
                instead = entered if isinstance(entered, Engine) else instead
            with delivery.running():
                engine, temporary = (
                    (instead, False) if instead is not None else delivery.load_engine()
                )
                try:
                    self._call(delivery, engine)
                finally:
                    if temporary:
                        engine.close()

    def _call(self, delivery: Delivery, engine: Engine) -> None:
        with ExitStack() as stack:
            for feature in self._hooks.around_call:
                enter(stack, feature.around_call(delivery, engine))
            if delivery.recorded is not None:  # recorded meanwhile (read under the lock)
                delivery.republish(delivery.recorded)
            else:
                awaited = any(f.awaits_record(delivery) for f in self._hooks.awaits_record)
                delivery.process(engine, self._recorders(delivery), awaited)

    def _recorders(self, delivery: Delivery) -> Callable[[StatePipeline], None]:
        def add(pipe: StatePipeline) -> None:
            for feature in self._hooks.recording:
                feature.recording(delivery, pipe)

        return add
