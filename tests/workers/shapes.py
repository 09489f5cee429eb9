"""Returns what the event asks for: one event, a list, a tuple, None or something invalid."""

from wm.devkit import make_event


def _event(index):
    return make_event("shapes.out", "/workers/shapes", {"index": index})


def process(event):
    shape = event.get_data()["shape"]
    if shape == "single":
        return _event(0)
    if shape == "list":
        return [_event(0), _event(1), _event(2)]
    if shape == "tuple":
        return (_event(0), _event(1))
    if shape == "none":
        return None
    return 42
