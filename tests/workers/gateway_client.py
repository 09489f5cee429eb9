"""An ApiWorker: forwards the event data to orders.create through the gateway."""

from wm.devkit import ApiWorker

API_HOST = "127.0.0.1"
API_PORT = 5002


class Forwarder(ApiWorker):
    def __init__(self):
        super().__init__(API_HOST, API_PORT, "orders.forwarded", "/workers/forwarder")

    def process(self, event):
        answer = self.api.gateway.orders.create(event.get_data())
        return self.response(event, {"answer": answer})
