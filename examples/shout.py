"""A worker on topic greetings that shouts the text it is given (the README's tour, and the
session of docs/guides/cli.md).

{"text": "hello"} on greetings becomes {"text": "HELLO"} on greetings.shouted, with the
input's correlationid (WorkerBase.response copies it).
"""

from wm.devkit import WorkerBase


class Shout(WorkerBase):
    def __init__(self):
        super().__init__("greetings.shouted", "/examples/shout")

    def process(self, event):
        return self.response(event, {"text": event.get_data()["text"].upper()})
