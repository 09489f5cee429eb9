"""A WorkerBase worker: routing through the constructor, responses through the helpers."""

from wm.devkit import WorkerBase


class Greeter(WorkerBase):
    def __init__(self):
        super().__init__("greetings.sent", "/workers/greeter")

    def process(self, event):
        name = (event.get_data() or {}).get("name")
        if not name:
            return self.error(event, "name is required")
        self.log("greeting %s", name)
        return self.response(event, {"greeting": f"Hello, {name}!"})
