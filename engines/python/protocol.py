"""What the frames between the host and the sandboxed runner hold. The frames themselves are
:mod:`engines.childproc.frames`; the Python sandbox's payloads are JSON objects:

* INIT: the launch configuration, then the worker's source (UTF-8) as the blob.
* READY: ``pid``, ``entry`` (``process`` or the WorkerBase subclass) and ``probe`` (whether
  the code has a health probe). FAILED at INIT: ``message`` says why the code was refused.
* CALL: the event in structured mode, as the bytes the ``cloudevents`` JSON format writes
  (so an event is serialised once per hop); its ANSWER: ``cpu_s``, ``events`` (each in
  structured mode, spliced in as written) and ``done`` when the worker declared it is done.
* PROBE (empty); its ANSWER: ``ok`` (null when the code has no probe, else whether it
  passed), ``cpu_s``, and ``message`` for a failed one.
* FAILED for a call or a probe: ``type``, ``message``, ``traceback``, and ``fatal`` when the
  child ends after it.
* LOG: the DevKit's levels as Python logging levels.
* GATEWAY: ``host``, ``port``, ``service``, ``method``, then the data as JSON; its
  GATEWAY_REPLY: GATEWAY_OK and the answer's JSON, or GATEWAY_FAILED and ``{"error": ...}``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from cloudevents.core.v1.event import CloudEvent

from engines.childproc.frames import FrameError
from wm.events import encode

#: Codes of a GATEWAY_REPLY (those of the native ABI's gateway_call).
GATEWAY_OK, GATEWAY_FAILED = 0, 1


def event_body(event: CloudEvent) -> bytes:
    """Payload of a CALL (host → child): what the SDK's JSON format writes."""
    return encode(event).encode("utf-8")


def result_body(events: Iterable[CloudEvent], cpu_s: float, done: str | None = None) -> bytes:
    """Payload of the ANSWER to a CALL (child → host); ``done``: the worker declared it is
    done (``wm.devkit.done``), for this reason."""
    encoded = ",".join(map(encode, events)).encode("utf-8")
    tail = b"" if done is None else b',"done":' + json.dumps(done).encode("utf-8")
    return b'{"cpu_s":%.3f,"events":[%s]%s}' % (cpu_s, encoded, tail)


class WorkerEvent(CloudEvent):
    """The event a Python worker's code gets: a CloudEvent (``get_type()``, ``get_data()``,
    ``get_extension(name)``, …) that also reads its attributes by name, as the CloudEvents
    SDK's HTTP events did: ``event["type"]``, ``event.get("subject")``, ``event.data``.

    Made only from a CALL, whose event the host decoded and checked: the SDK's checks (a
    third of the child's work on a small event) are not run again."""

    @staticmethod
    def _validate_attribute(attributes: dict[str, Any]) -> None:
        pass

    def __getitem__(self, name: str) -> Any:
        attributes = self.get_attributes()
        if name in attributes:
            return attributes[name]
        if name == "data":
            return self.get_data()
        raise KeyError(
            f"the event has no attribute {name!r}; it has {', '.join(sorted(attributes))} and data"
        )

    def __contains__(self, name: object) -> bool:
        return name == "data" or name in self.get_attributes()

    def get(self, name: str, default: Any = None) -> Any:
        """The attribute (or extension) ``name``, or ``default`` when the event has none."""
        if name == "data":
            return self.get_data()
        return self.get_attributes().get(name, default)

    @property
    def data(self) -> Any:
        return self.get_data()


def event_from_json(obj: Any) -> CloudEvent:
    """A CloudEvent from its structured-mode JSON object (as ``JSONFormat.read`` does)."""
    if not isinstance(obj, dict):
        raise FrameError("event is not a JSON object")
    attributes = dict(obj)
    data = attributes.pop("data", None)
    data_base64 = attributes.pop("data_base64", None)
    if data is None and data_base64 is not None:
        data = base64.b64decode(data_base64)
    if isinstance(attributes.get("time"), str):
        try:
            attributes["time"] = datetime.fromisoformat(attributes["time"])
        except ValueError as exc:
            raise FrameError(f"event time is not ISO 8601: {exc}") from exc
    return WorkerEvent(attributes, data)


def answer_event(obj: Any) -> CloudEvent:
    """An output event of an ANSWER, already parsed from its JSON: what
    :func:`wm.events.decode` reads, without writing and parsing the JSON again (the host's
    share of a round trip). Raises :class:`wm.errors.EventDecodeError`."""
    from wm.events import decode_object  # the host's alone: the child never decodes one

    return decode_object(dict(obj) if isinstance(obj, dict) else obj)
