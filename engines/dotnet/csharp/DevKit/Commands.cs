using System;
using System.Collections.Generic;
using System.Text.Json;
using System.Text.Json.Nodes;
using System.Threading.Tasks;

namespace Virtufin.Worker.DevKit
{
    /// <summary>Dispatches <c>{"command": "&lt;name&gt;", ...}</c> to
    /// <see cref="HandleAsync"/> with the member of the enum <typeparamref name="T"/> whose
    /// identifier matches (case-insensitively; the wire name is the lower-case identifier).
    /// Failures are answered with error responses: <c>Failed to parse command JSON</c>,
    /// <c>Missing 'command' field</c>, <c>Unknown command: &lt;command&gt;</c>,
    /// <c>Internal error: &lt;message&gt;</c>.</summary>
    /// <remarks>The seed declares <c>where T : struct, Enum</c>, as built by Roslyn (a .NET
    /// SDK); C# 7.2 (mcs) cannot express the Enum constraint, so there it is checked when the
    /// worker is constructed.</remarks>
#if ENUM_CONSTRAINT
    public abstract class CommandWorker<T> : WorkerBase where T : struct, Enum
#else
    public abstract class CommandWorker<T> : WorkerBase where T : struct
#endif
    {
        public const string ParseError = "Failed to parse command JSON";
        public const string MissingCommand = "Missing 'command' field";

        protected CommandWorker(string responseType, string source) : base(responseType, source)
        {
            if (!typeof(T).IsEnum)
                throw new ArgumentException(
                    GetType().Name + " must be a CommandWorker<T> whose T is an enum, not " + typeof(T).Name);
        }

        public sealed override async Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            JsonObject node = ParseCommand(input.Data);
            if (node == null) return Error(input, ParseError);
            JsonNode commandNode;
            if (!node.TryGetPropertyValue("command", out commandNode) || commandNode == null)
                return Error(input, MissingCommand);
            string command;
            JsonValue value = commandNode as JsonValue;
            if (value == null || !value.TryGetValue<string>(out command))
                command = commandNode.ToJsonString();
            T parsed;
            if (!IsMemberName(command) || !Enum.TryParse<T>(command, true, out parsed))
                return Error(input, "Unknown command: " + command);
            try
            {
                BeforeHandle(node);
                return await HandleAsync(input, parsed, node).ConfigureAwait(false);
            }
            catch (Exception e)
            {
                Log("error", "command " + command + " failed: " + e.GetType().FullName + ": " + e.Message);
                CloudEvent answer = Error(input, "Internal error: " + e.Message);
                answer.AnsweredErrorType = e.GetType().FullName;
                return answer;
            }
        }

        /// <summary>Handles one parsed command; <paramref name="node"/> is the whole command
        /// object.</summary>
        protected abstract Task<CloudEvent> HandleAsync(CloudEvent input, T command, JsonNode node);

        /// <summary>Runs before <see cref="HandleAsync"/> (ApiCommandWorker configures its
        /// client here).</summary>
        protected virtual void BeforeHandle(JsonObject node) { }

        // The enum's member names, read once (Enum.GetNames copies them into a new array).
        // Not in a static initializer: a T that is no enum must fail in the constructor.
        static string[] memberNames;

        // Enum.TryParse also accepts numbers and comma-separated lists; only identifiers are
        // wire names.
        static bool IsMemberName(string command)
        {
            if (string.IsNullOrEmpty(command)) return false;
            string[] names = memberNames ?? (memberNames = Enum.GetNames(typeof(T)));
            foreach (string name in names)
                if (string.Equals(name, command, StringComparison.OrdinalIgnoreCase)) return true;
            return false;
        }

        static JsonObject ParseCommand(object data)
        {
            JsonNode node = data as JsonNode;
            if (node == null)
            {
                string text = data as string;
                byte[] bytes = data as byte[];
                try
                {
                    if (text != null) node = JsonNode.Parse(text);
                    else if (bytes != null) node = JsonNode.Parse(bytes);
                }
                catch (JsonException) { return null; }
                catch (ArgumentException) { return null; }
            }
            return node as JsonObject;
        }
    }

    /// <summary>A command worker whose <see cref="Api"/> follows each command's
    /// <c>api_host</c> / <c>api_port</c> (default port 5002); without <c>api_host</c> the
    /// constructor's host, if any, is used.</summary>
#if ENUM_CONSTRAINT
    public abstract class ApiCommandWorker<T> : CommandWorker<T> where T : struct, Enum
#else
    public abstract class ApiCommandWorker<T> : CommandWorker<T> where T : struct
#endif
    {
        ApiClient api;

        protected ApiCommandWorker(string responseType, string source) : base(responseType, source) { }

        protected ApiCommandWorker(string apiHost, int apiPort, string responseType, string source)
            : base(responseType, source)
        {
            api = new ApiClient(apiHost, apiPort);
        }

        /// <summary>The gateway client for the current command.</summary>
        public ApiClient Api
        {
            get
            {
                if (api == null)
                    throw new GatewayException(
                        "no API host configured: send 'api_host' in the command or pass apiHost");
                return api;
            }
        }

        protected override void BeforeHandle(JsonObject node)
        {
            JsonNode hostNode, portNode;
            string host;
            if (!node.TryGetPropertyValue("api_host", out hostNode) || hostNode == null) return;
            if (!(hostNode is JsonValue) || !hostNode.AsValue().TryGetValue<string>(out host))
                throw new GatewayException("api_host must be a string");
            int port = ApiClient.DefaultPort;
            if (node.TryGetPropertyValue("api_port", out portNode) && portNode != null)
            {
                if (!(portNode is JsonValue) || !portNode.AsValue().TryGetValue<int>(out port))
                    throw new GatewayException("api_port must be an integer");
            }
            if (api == null || api.Host != host || api.Port != port) api = new ApiClient(host, port);
        }
    }
}
