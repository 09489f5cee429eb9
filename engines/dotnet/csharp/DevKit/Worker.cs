using System;
using System.Threading.Tasks;

namespace Virtufin.Worker.DevKit
{
    /// <summary>A worker: one public class with a parameterless constructor per assembly.
    /// It may have a health probe: a public <c>Task&lt;bool&gt; ProbeAsync()</c> (see
    /// <see cref="WorkerBase.ProbeAsync"/>).</summary>
    public interface IWorker
    {
        /// <summary>Handles one event. The result (the task's value) may be null: no output.
        /// The host awaits the task; it never blocks a thread-pool thread waiting on it.</summary>
        Task<CloudEvent> ProcessAsync(CloudEvent input);
    }

    /// <summary>Base of workers: routing comes through the constructor.</summary>
    public abstract class WorkerBase : IWorker
    {
        /// <summary>Suffix of the type of error responses: <c>&lt;responseType&gt;.error</c>.</summary>
        public const string ErrorTypeSuffix = ".error";

        protected WorkerBase(string responseType, string source)
        {
            if (string.IsNullOrEmpty(responseType))
                throw new ArgumentException("responseType must be a non-empty string", "responseType");
            if (string.IsNullOrEmpty(source))
                throw new ArgumentException("source must be a non-empty string", "source");
            ResponseType = responseType;
            Source = source;
        }

        public string ResponseType { get; private set; }
        public string Source { get; private set; }

        public abstract Task<CloudEvent> ProcessAsync(CloudEvent input);

        /// <summary>Health probe, optional: override it to have WorkManager call it every
        /// <c>probe_interval_s</c> (worker setting, default 30) on one node at a time, within
        /// the worker's <c>timeout_s</c>. Answer true when the worker can do its work (its
        /// backends answer, say); false, an exception (its message the reason) or a probe that
        /// outlives its time limit is a failed probe, and <c>max_probe_failures</c> (default 3)
        /// in a row make the worker unhealthy. Not overridden, the worker has no probe and is
        /// never probed. A worker implementing <see cref="IWorker"/> directly declares the same
        /// public method.</summary>
        public virtual Task<bool> ProbeAsync()
        {
            throw new NotSupportedException("WorkerBase.ProbeAsync() is optional; override it to have one.");
        }

        /// <summary>A response of type <see cref="ResponseType"/> carrying the input's
        /// correlation id.</summary>
        protected CloudEvent Response(CloudEvent input, object data)
        {
            var output = new CloudEvent(ResponseType, Source, data);
            return output.WithCorrelationId(input);
        }

        /// <summary>An error response: type <c>&lt;responseType&gt;.error</c>, data
        /// <c>{"error": message}</c>, the input's correlation id.</summary>
        protected CloudEvent Error(CloudEvent input, string message)
        {
            var data = new System.Text.Json.Nodes.JsonObject();
            data["error"] = message;
            var output = new CloudEvent(ResponseType + ErrorTypeSuffix, Source, data);
            output.AnsweredError = message;
            return output.WithCorrelationId(input);
        }

        /// <summary>Logs through the host's logger, tagged with the worker's id. Levels:
        /// trace, debug, info, warning, error.</summary>
        protected void Log(string level, string message)
        {
            WorkerHost.Log(level, message);
        }
    }

    /// <summary>A worker with an <see cref="ApiClient"/> for a fixed host and port.</summary>
    public abstract class ApiWorker : WorkerBase
    {
        protected ApiWorker(string apiHost, int apiPort, string responseType, string source)
            : base(responseType, source)
        {
            Api = new ApiClient(apiHost, apiPort);
        }

        public ApiClient Api { get; private set; }

        public sealed override Task<CloudEvent> ProcessAsync(CloudEvent input)
        {
            return ProcessAsync(input, Api);
        }

        public abstract Task<CloudEvent> ProcessAsync(CloudEvent input, ApiClient api);
    }
}
