"""``wm.events.encode`` writes what the CloudEvents SDK's ``JSONFormat.write`` writes, by a
shorter way for JSON data (``publish_many`` encodes every event), and ``wm.events.decode``
reads what its ``JSONFormat.read`` reads (every delivery decodes its event), from the one
parse it makes: property-based, seeded by the test's seed (``TEST_SEED`` replays a
failure)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from cloudevents.core.exceptions import BaseCloudEventException
from cloudevents.core.formats.json import JSONFormat
from cloudevents.core.v1.event import CloudEvent
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_poison_properties import hostile_text, json_data, seed_with
from wm.errors import EventDecodeError
from wm.events import (
    decode,
    derive_id,
    encode,
    event_key,
    json_writer,
    make_event,
    parse_json,
    rfc3339,
)

moments = st.datetimes(
    min_value=datetime(1, 1, 2),
    timezones=st.sampled_from([UTC, timezone(timedelta(hours=5, minutes=30))]),
)
data = st.one_of(
    json_data,
    st.binary(max_size=20),
    st.dictionaries(hostile_text, moments, max_size=2),  # the SDK's encoder writes datetimes
)
content_types = st.sampled_from(
    [None, "application/json", "application/cloudevents+json", "text/plain", "text/json; x=1"]
)
EXAMPLES = 200
extensions = st.dictionaries(st.sampled_from(["partitionkey", "tenant", "ext"]), hostile_text)


def test_encode_writes_what_the_sdk_writes(seed: int) -> None:
    @seed_with(seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(data, content_types, extensions, moments)
    def check(value: Any, content_type: str | None, more: dict[str, str], at: datetime) -> None:
        attributes = {"type": "t", "source": "/s", "id": "1", "specversion": "1.0", "time": at}
        if content_type is not None:
            attributes["datacontenttype"] = content_type
        event = CloudEvent({**attributes, **more}, value)
        assert encode(event) == JSONFormat().write(event).decode("utf-8")

    check()


EDGE_TIMES = [
    datetime(1, 1, 2, tzinfo=UTC),
    datetime(2026, 12, 3, 9, 5, 7, 1, tzinfo=UTC),
    datetime(9999, 12, 31, 23, 59, 59, 999999, tzinfo=UTC),
    datetime(2026, 1, 1, tzinfo=timezone(timedelta(0))),  # UTC, not the singleton
    datetime(2026, 1, 1, 12, 0, 0, 500, tzinfo=timezone(timedelta(hours=-3))),
]


def test_rfc3339_writes_a_time_as_the_sdk_does(seed: int) -> None:
    """The engines and ``encode`` write a time with ``rfc3339`` (one formatting pass for a
    UTC time): its text is the SDK's, with and without microseconds, in any zone."""

    def sdk(at: datetime) -> str:
        event = CloudEvent(
            {"type": "t", "source": "/s", "id": "1", "specversion": "1.0", "time": at}
        )
        return str(json.loads(JSONFormat().write(event))["time"])

    for at in EDGE_TIMES:
        assert rfc3339(at) == sdk(at)

    @seed_with(seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(st.one_of(moments, moments.map(lambda at: at.replace(microsecond=0))))
    def check(at: datetime) -> None:
        assert rfc3339(at) == sdk(at)

    check()


def test_data_that_is_no_json_fails_as_with_the_sdk() -> None:
    event = make_event("t", "/s", {"x": object()})
    with pytest.raises(TypeError, match="not JSON serializable"):
        JSONFormat().write(event)
    with pytest.raises(TypeError, match="not JSON serializable"):
        encode(event)


#: Timestamps as publishers write them: RFC 3339 with 0–9 fractional digits and any offset,
#: and the ISO 8601 forms only dateutil reads (``24:00``, a week date, no seconds, no zone).
timestamps = st.one_of(
    st.builds(
        lambda moment, fraction, zone: (
            moment.isoformat(timespec="seconds") + (f".{fraction}" if fraction else "") + zone
        ),
        st.datetimes(min_value=datetime(1, 1, 2)),
        st.text("0123456789", max_size=9),
        st.sampled_from(["Z", "+00:00", "-00:00", "+05:30", "-11:45", "+23:59"]),
    ),
    st.sampled_from(
        ["2026-12-02T24:00:00Z", "2026-W48-3T10:00:00Z", "2026-12-02T10:00Z", "2026-12-02T10:00:00"]
    ),
)


def test_decode_reads_what_the_sdk_reads(seed: int) -> None:
    @seed_with(seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(data, content_types, extensions, timestamps)
    def check(value: Any, content_type: str | None, more: dict[str, str], at: str) -> None:
        attributes = {"type": "t", "source": "/s", "id": "1", "specversion": "1.0"}
        if content_type is not None:
            attributes["datacontenttype"] = content_type
        written = json.loads(encode(CloudEvent({**attributes, **more}, value)))
        text = json.dumps({**written, "time": at})
        try:
            sdks = JSONFormat().read(None, text)
        except (BaseCloudEventException, ValueError, OverflowError):  # e.g. no time zone
            with pytest.raises(EventDecodeError):
                decode(text)
            return
        ours = decode(text)
        assert ours.get_attributes() == sdks.get_attributes()
        assert ours.get_data() == sdks.get_data()
        assert ours.get_time().isoformat() == sdks.get_time().isoformat()

    check()


def _loaded(text: str | bytes) -> tuple[str, Any]:
    """What ``json.loads`` gives for ``text``: its value, or its error's type and message."""
    try:
        return "value", json.loads(text)
    except (ValueError, RecursionError) as exc:
        return "error", (type(exc), str(exc))


def _parsed(text: str | bytes) -> tuple[str, Any]:
    try:
        return "value", parse_json(text)
    except (ValueError, RecursionError) as exc:
        return "error", (type(exc), str(exc))


JSON_EDGES = [
    ' {"a": 1}',  # whitespace around: json.loads's own path
    '{"a": 1}\n',
    '{"a": 1} x',  # extra data
    '{"a": 1',  # cut short
    "",
    "\ufeff{}",  # a byte-order mark
    "NaN",
    '"\\ud800"',  # a lone surrogate, escaped
    '[1, 2.5e3, true, null, "é"]',
    b'{"a": 1}',  # bytes: read as UTF-8 by the scanner
    '["é", 1]'.encode(),
    b"\xff",
    b'\xef\xbb\xbf{"a": 1}',  # UTF-8 with a byte-order mark: json.loads's own path
    '{"a": [1]}'.encode("utf-16"),  # other encodings json.loads detects
    '{"a": [1]}'.encode("utf-16-le"),
    '"x"'.encode("utf-32-be"),
    b'"\xed\xa0\x80"',  # a lone surrogate in UTF-8: json.loads lets it pass
    b"1 ",
]


@pytest.mark.parametrize("text", JSON_EDGES)
def test_parse_json_is_json_loads_at_the_edges(text: str | bytes) -> None:
    assert _parsed(text) == _loaded(text)


def test_parse_json_is_json_loads(seed: int) -> None:
    """Every delivery and every native or .NET answer is read by ``parse_json``: its value,
    or its error, is ``json.loads``'s, for JSON documents and for those texts cut short."""

    @seed_with(seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(json_data, st.integers(min_value=0, max_value=40))
    def check(value: Any, cut: int) -> None:
        text = json.dumps(value)
        short = text[: len(text) - cut]
        for candidate in (text, short, json.dumps(value, indent=1), text.encode(), short.encode()):
            assert _parsed(candidate) == _loaded(candidate), candidate

    check()


WRITER_OPTIONS = [
    {},
    {"separators": (",", ":")},
    {"ensure_ascii": False, "allow_nan": False, "separators": (",", ":"), "default": str},
    {"sort_keys": True, "skipkeys": True},
]


def test_json_writer_writes_what_json_encoder_writes(seed: int) -> None:
    """The native and .NET engines write event data with ``json_writer``: for every value
    and each set of options the engines and others use, its text, or its error, is
    ``json.JSONEncoder(check_circular=False, **options).encode``'s."""
    writers = [
        (json_writer(**o), json.JSONEncoder(check_circular=False, **o)) for o in WRITER_OPTIONS
    ]

    @seed_with(seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(st.one_of(json_data, st.floats(), st.dictionaries(st.integers(), st.text(), max_size=3)))
    def check(value: Any) -> None:
        for write, encoder in writers:
            assert _written(write, value) == _written(encoder.encode, value)

    check()
    with pytest.raises(TypeError, match="not JSON serializable"):
        json_writer()({"x": object()})


def _written(write: Any, value: Any) -> str:
    try:
        return str(write(value))
    except (TypeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"


def test_keys_and_output_ids_are_uuid5s_of_what_identifies_them(seed: int) -> None:
    """Recorded outcomes and output ids are found again by these keys, across releases: they
    stay ``uuid.uuid5`` of the event's source and id (of the key, worker and position for an
    output); text ``uuid5`` cannot encode (a lone surrogate) still gets a key of its own."""
    namespace = uuid.UUID("0f4c2a3e-5d1b-4b7e-9a61-3c8e2f7d9b10")

    @seed_with(seed)
    @settings(max_examples=EXAMPLES, deadline=None, database=None)
    @given(st.text(min_size=1), hostile_text, st.integers(min_value=0, max_value=10_000))
    def check(source: str, event_id: str, index: int) -> None:
        key = event_key(source, event_id)
        name = f"{source}\x00{event_id}"
        try:
            expected = uuid.uuid5(namespace, name)
        except UnicodeEncodeError:  # a lone surrogate: its own key, not another text's
            assert key != event_key(source, event_id.encode("utf-8", "replace").decode())
        else:
            assert key == str(expected)
        assert derive_id(key, "w", index) == str(uuid.uuid5(namespace, f"{key}\x00w\x00{index}"))

    check()
