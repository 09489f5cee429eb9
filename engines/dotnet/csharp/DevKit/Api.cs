using System;
using System.Dynamic;
using System.Reflection;
using System.Text.Json;
using System.Text.Json.Nodes;
using System.Threading;
using System.Threading.Tasks;

namespace Virtufin.Worker.DevKit
{
    /// <summary>JSON text of any value: a JsonNode as is, anything else through
    /// JsonSerializer. (mcs cannot pick among JsonSerializer's overloads: some name types it
    /// cannot see, so the one used is taken by reflection.)</summary>
    static class Json
    {
        static readonly MethodInfo serialize = typeof(JsonSerializer).GetMethod(
            "Serialize", new[] { typeof(object), typeof(Type), typeof(JsonSerializerOptions) });

        internal static string Serialize(object data)
        {
            if (data == null) return "null";
            JsonNode node = data as JsonNode;
            if (node != null) return node.ToJsonString();
            string text = data as string;
            if (text != null) return JsonValue.Create(text).ToJsonString();
            try { return (string)serialize.Invoke(null, new object[] { data, data.GetType(), null }); }
            catch (TargetInvocationException e) { throw e.InnerException; }
        }
    }

    /// <summary>A gateway call was refused or failed (the message says why).</summary>
    public class GatewayException : Exception
    {
        public GatewayException(string message) : base(message) { }
    }

    /// <summary>Calls backend services through the host's API gateway:
    /// <c>dynamic gateway = Api.Gateway; JsonNode answer = await gateway.orders.create(data);</c>.
    /// The worker opens no socket: the host performs the call, only to hosts it allows
    /// (WM_GATEWAY_ALLOWED_HOSTS), within the message's time limit.</summary>
    public sealed class ApiClient
    {
        public const int DefaultPort = 5002;

        public ApiClient(string host, int port)
        {
            if (string.IsNullOrEmpty(host)) throw new ArgumentException("host must be non-empty", "host");
            if (port <= 0 || port > 65535) throw new ArgumentOutOfRangeException("port", port, "not a TCP port");
            Host = host;
            Port = port;
        }

        public string Host { get; private set; }
        public int Port { get; private set; }

        /// <summary><c>gateway.&lt;service&gt;</c> is a <see cref="ServiceClient"/>.</summary>
        public dynamic Gateway { get { return new GatewayNode(this); } }

        public ServiceClient Service(string name) { return new ServiceClient(this, name); }

        /// <summary>POSTs <paramref name="data"/> (JSON) to <c>/service/method</c>; the
        /// answer's JSON (null for JSON null).</summary>
        public Task<JsonNode> CallAsync(string service, string method, object data)
        {
            string request = Json.Serialize(data);
            string answer = WorkerHost.Gateway(Host, Port, service, method, request);
            return Task.FromResult(JsonNode.Parse(answer));
        }

        sealed class GatewayNode : DynamicObject
        {
            readonly ApiClient client;
            public GatewayNode(ApiClient client) { this.client = client; }

            public override bool TryGetMember(GetMemberBinder binder, out object result)
            {
                result = new ServiceClient(client, binder.Name);
                return true;
            }
        }
    }

    /// <summary>One backend service; <c>service.&lt;method&gt;(data)</c> calls it.</summary>
    public sealed class ServiceClient : DynamicObject
    {
        readonly ApiClient client;

        public ServiceClient(ApiClient client, string name)
        {
            this.client = client;
            Name = name;
        }

        public string Name { get; private set; }

        public Task<JsonNode> CallAsync(string method, object data)
        {
            return client.CallAsync(Name, method, data);
        }

        public override bool TryInvokeMember(InvokeMemberBinder binder, object[] args, out object result)
        {
            if (args.Length > 1)
                throw new ArgumentException("a gateway method takes one argument, the request data");
            result = CallAsync(binder.Name, args.Length == 1 ? args[0] : null);
            return true;
        }
    }

    /// <summary>What the host does for its workers (logging, gateway calls). The host sets
    /// the hooks and the per-call context; worker code calls them through the DevKit.</summary>
    public static class WorkerHost
    {
        /// <summary>(level, worker id, message).</summary>
        public static Action<string, string, string> LogHook;
        /// <summary>(worker id, host, port, service, method, request JSON, remaining ms) →
        /// "ok\0json" or "error\0message".</summary>
        public static Func<string, string, int, string, string, string, long, string> GatewayHook;

        /// <summary>The running call (null outside calls): one value, set and cleared once
        /// per call (each change of an AsyncLocal copies the execution context).</summary>
        internal static readonly AsyncLocal<Call> Current = new AsyncLocal<Call>();

        internal sealed class Call
        {
            internal readonly string WorkerId;
            /// <summary>When the call's time limit ends, in UTC ticks.</summary>
            internal readonly long DeadlineTicks;

            internal Call(string workerId, long deadlineTicks)
            {
                WorkerId = workerId;
                DeadlineTicks = deadlineTicks;
            }
        }

        /// <summary>The id of the worker whose call is running, or null outside calls.</summary>
        public static string CurrentWorkerId { get { Call call = Current.Value; return call == null ? null : call.WorkerId; } }

        internal static void Log(string level, string message)
        {
            Action<string, string, string> hook = LogHook;
            if (hook != null) hook(level, CurrentWorkerId, message);
            else Console.Error.WriteLine(level + ": " + message);
        }

        internal static string Gateway(string host, int port, string service, string method, string request)
        {
            Func<string, string, int, string, string, string, long, string> hook = GatewayHook;
            if (hook == null) throw new GatewayException("no gateway: the worker runs outside WorkManager");
            Call call = Current.Value;
            long deadline = call == null ? 0 : call.DeadlineTicks;
            long remainingMs = deadline == 0 ? long.MaxValue
                : (deadline - DateTime.UtcNow.Ticks) / TimeSpan.TicksPerMillisecond;
            if (deadline != 0 && remainingMs <= 0)
                throw new GatewayException("no time left for the gateway call within the message time limit");
            string reply = hook(call == null ? null : call.WorkerId, host, port, service, method, request, remainingMs);
            int split = reply.IndexOf('\0');
            string status = split < 0 ? reply : reply.Substring(0, split);
            string body = split < 0 ? "" : reply.Substring(split + 1);
            if (status != "ok") throw new GatewayException(body);
            return body;
        }
    }
}
