// An example C# worker for WorkManager: a command worker over an enum (the wire name of a
// command is the member's identifier in lower case). Create it as source:
//   wm worker create orders --topic orders.in --mime text/x-csharp --code-file CommandWorker.cs
// or compile it against the DevKit into a DLL and ship it in a nupkg (see docs/guides/dotnet-workers.md).
using System;
using System.Text.Json.Nodes;
using System.Threading.Tasks;
using Virtufin.Worker.DevKit;

namespace Examples
{
    public enum OrderCommand { upper, echo, fail, lookup, slow }

    public sealed class OrderWorker : ApiCommandWorker<OrderCommand>
    {
        public OrderWorker() : base("orders.done", "/workers/orders") { }

        protected override async Task<CloudEvent> HandleAsync(CloudEvent input, OrderCommand command, JsonNode node)
        {
            switch (command)
            {
                case OrderCommand.upper:
                    var upper = new JsonObject();
                    upper["text"] = ((string)node["text"]).ToUpperInvariant();
                    return Response(input, upper);
                case OrderCommand.echo:
                    return Response(input, node.DeepClone());
                case OrderCommand.fail:
                    throw new InvalidOperationException("asked to fail");
                case OrderCommand.lookup:
                    // through the host's allow-listed gateway: POST http://api_host:api_port/orders/find
                    dynamic gateway = Api.Gateway;
                    JsonNode found = await gateway.orders.find(node["query"]);
                    return Response(input, found);
                case OrderCommand.slow:
                    await Task.Delay((int)node["ms"]);
                    return Response(input, node.DeepClone());
                default:
                    return Error(input, "unhandled command " + command);
            }
        }
    }
}
