"""Echoes the input data; prints a line and logs one, to show neither corrupts the protocol."""

from wm.devkit import make_event

OUTPUT_TYPE = "echo.out"


def process(event):
    print("echo worker saw", event.get_id())
    return make_event(OUTPUT_TYPE, "/workers/echo", {"input": event.get_data()})
