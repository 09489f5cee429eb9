// Virtufin.Worker.DevKit: the contract between WorkManager and a .NET worker.
// C# 7.2 (Mono's mcs compiles it when no .NET SDK is installed): no nullable annotations,
// so "may be null" is said in the comments.
using System;
using System.Collections.Generic;
using System.Globalization;
using System.Runtime.CompilerServices;

[assembly: InternalsVisibleTo("WorkManager.DotNet.Host")]

namespace Virtufin.Worker.DevKit
{
    /// <summary>A CloudEvents 1.0 event as a worker sees it.</summary>
    /// <remarks>
    /// <see cref="Data"/> is a <c>System.Text.Json.Nodes.JsonNode</c> for JSON data (null for
    /// JSON <c>null</c>), a <c>string</c> for text, a <c>byte[]</c> for binary data, or null
    /// when the event has none. On an output, any other object is serialized as JSON.
    /// </remarks>
    public sealed class CloudEvent
    {
        /// <summary>The extension that ties a response to its request.</summary>
        public const string CorrelationIdExtension = "correlationid";

        readonly Dictionary<string, string> extensions =
            new Dictionary<string, string>(StringComparer.Ordinal);

        public CloudEvent() { Id = Guid.NewGuid().ToString(); }

        /// <summary>An event whose id is given: the host's copy of an input (a new id would
        /// cost a random read for nothing).</summary>
        internal CloudEvent(string id) { Id = id; }

        public CloudEvent(string type, string source, object data) : this()
        {
            Type = type;
            Source = source;
            Data = data;
        }

        public string Id { get; set; }
        public string Source { get; set; }
        public string Type { get; set; }
        /// <summary>May be null.</summary>
        public string Subject { get; set; }
        /// <summary>May be null; set to application/json for JSON data on outputs.</summary>
        public string DataContentType { get; set; }
        /// <summary>RFC 3339 timestamp; may be null.</summary>
        public string Time
        {
            get
            {
                if (timeIsPending)
                {
                    time = UtcText(pendingMicroseconds);
                    timeIsPending = false;
                }
                return time;
            }
            set
            {
                time = value;
                timeIsPending = false;
            }
        }

        string time;
        long pendingMicroseconds;
        bool timeIsPending;

        /// <summary>Sets <see cref="Time"/> to a UTC instant, microseconds since the Unix epoch,
        /// written as text (as Python's <c>isoformat</c> writes it) only when it is read: most
        /// workers never read an input's time.</summary>
        internal void SetUtcTime(long unixMicroseconds)
        {
            pendingMicroseconds = unixMicroseconds;
            timeIsPending = true;
        }

        const long UnixEpochTicks = 621355968000000000;

        static string UtcText(long unixMicroseconds)
        {
            var at = new DateTime(UnixEpochTicks + unixMicroseconds * 10, DateTimeKind.Utc);
            string format = unixMicroseconds % 1000000 == 0
                ? "yyyy-MM-dd'T'HH:mm:ss'+00:00'"
                : "yyyy-MM-dd'T'HH:mm:ss.ffffff'+00:00'";
            return at.ToString(format, CultureInfo.InvariantCulture);
        }
        /// <summary>May be null (see the class remarks for the types it holds).</summary>
        public object Data { get; set; }

        /// <summary>Extension attributes by name (lower case, as CloudEvents requires).</summary>
        public IDictionary<string, string> Extensions { get { return extensions; } }

        /// <summary>The extension <paramref name="name"/>, or null when absent; setting null
        /// removes it.</summary>
        public string this[string name]
        {
            get { string value; return extensions.TryGetValue(name, out value) ? value : null; }
            set { if (value == null) extensions.Remove(name); else extensions[name] = value; }
        }

        /// <summary>The error message when this event is an error response made by
        /// <see cref="WorkerBase.Error"/>; the host reports it as a worker error.</summary>
        internal string AnsweredError { get; set; }

        /// <summary>The type the host reports <see cref="AnsweredError"/> as: the .NET type of
        /// the exception it answers (a <see cref="CommandWorker{T}"/> handler's), or null for an
        /// error the worker answered with itself.</summary>
        internal string AnsweredErrorType { get; set; }
    }

    public static class CloudEventExtensions
    {
        /// <summary>Copies the input's <c>correlationid</c> onto <paramref name="output"/>;
        /// a no-op when the input has none. Returns <paramref name="output"/>.</summary>
        public static CloudEvent WithCorrelationId(this CloudEvent output, CloudEvent input)
        {
            if (output == null) throw new ArgumentNullException("output");
            string id = input == null ? null : input[CloudEvent.CorrelationIdExtension];
            if (id != null) output[CloudEvent.CorrelationIdExtension] = id;
            return output;
        }
    }
}
