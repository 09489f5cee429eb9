"""An ApiCommandWorker: the API host comes with each command (api_host, api_port)."""

from enum import Enum

from wm.devkit import ApiCommandWorker


class Lookup(Enum):
    price = 1


class PriceLookup(ApiCommandWorker[Lookup]):
    def __init__(self):
        super().__init__("prices.found", "/workers/prices")

    def handle(self, event, command, node):
        answer = self.api.gateway.catalog.price({"sku": node["sku"]})
        return self.response(event, {"price": answer, "via": f"{self.api.host}:{self.api.port}"})
