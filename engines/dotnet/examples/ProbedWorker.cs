// An example C# worker with a health probe. WorkManager calls ProbeAsync every
// probe_interval_s (worker setting, default 30 s) on one node, within the worker's timeout_s:
// true is healthy; false, an exception (its message the reason) or a probe outliving the
// limit is a failed probe, and max_probe_failures (default 3) in a row make the worker
// unhealthy. A worker without ProbeAsync is never probed.
//
// A real probe asks its backends (await Api.Gateway.orders.ping(...)); this one answers what
// its last {"command": "health", "answer": "healthy" | "unhealthy" | "throw" | "hang", "ms": N}
// event said ("hang" waits N ms, forever without "ms"), so it doubles as a test fixture:
//   wm worker create probed --topic probed.in --mime text/x-csharp --code-file ProbedWorker.cs
using System;
using System.Text.Json.Nodes;
using System.Threading;
using System.Threading.Tasks;
using Virtufin.Worker.DevKit;

namespace Examples
{
    public enum ProbedCommand { health, echo }

    public sealed class ProbedWorker : CommandWorker<ProbedCommand>
    {
        volatile string answer = "healthy";
        int hangMs = Timeout.Infinite;

        public ProbedWorker() : base("probed.done", "/workers/probed") { }

        protected override Task<CloudEvent> HandleAsync(CloudEvent input, ProbedCommand command, JsonNode node)
        {
            if (command == ProbedCommand.health)
            {
                hangMs = node["ms"] == null ? Timeout.Infinite : (int)node["ms"];
                answer = (string)node["answer"];
            }
            return Task.FromResult(Response(input, node.DeepClone()));
        }

        public override async Task<bool> ProbeAsync()
        {
            switch (answer)
            {
                case "healthy":
                    return true;
                case "throw":
                    throw new InvalidOperationException("the orders database is unreachable");
                case "hang":
                    await Task.Delay(hangMs);
                    return true;
                default:
                    return false;
            }
        }
    }
}
