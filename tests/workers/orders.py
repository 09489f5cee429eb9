"""A CommandWorker over an Enum: the wire name of OrderCommand.create is "create"."""

from enum import Enum

from wm.devkit import CommandWorker


class OrderCommand(Enum):
    create = 1
    cancel = 2
    explode = 3


class Orders(CommandWorker[OrderCommand]):
    def __init__(self):
        super().__init__("orders.result", "/workers/orders")

    def handle(self, event, command, node):
        if command is OrderCommand.create:
            return self.response(event, {"created": node.get("item")})
        if command is OrderCommand.cancel:
            return [self.response(event, {"cancelled": node.get("id")})]
        raise ValueError("the order exploded")
