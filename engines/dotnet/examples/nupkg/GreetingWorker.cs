// An example compiled worker with a sibling dependency (Greeter.dll). Build and pack it
// without a .NET SDK:
//   python -m engines.dotnet compile Greeter.cs -o Greeter.dll
//   python -m engines.dotnet compile GreetingWorker.cs -r Greeter.dll -o GreetingWorker.dll
//   python -m engines.dotnet pack GreetingWorker.dll Greeter.dll --id GreetingWorker -o greeting.nupkg
using System.Text.Json.Nodes;
using System.Threading.Tasks;
using Examples.Greeting;
using Virtufin.Worker.DevKit;

namespace Examples
{
    public sealed class GreetingWorker : WorkerBase
    {
        public GreetingWorker() : base("greetings.done", "/workers/greeting") { }

        public override Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            var node = input.Data as JsonObject;
            string name = node == null ? null : (string)node["name"];
            if (name == null) return Task.FromResult(Error(input, "data needs a 'name'"));
            var data = new JsonObject();
            data["greeting"] = Greeter.Greet(name);
            data["worker"] = WorkerHost.CurrentWorkerId;
            return Task.FromResult(Response(input, data));
        }
    }
}
