// WorkManager.DotNet.Host: the engine's side inside the runtime. Python drives it with
// strings, and an event's round trip with UTF-8 bytes through a function pointer
// (ProcessEntry): a worker object, its types, its exceptions or its tasks never reach Python,
// because pythonnet caches what it touches and would keep an unloaded context alive.
using System;
using System.Collections.Generic;
using System.Globalization;
using System.IO;
using System.Reflection;
using System.Runtime.InteropServices;
using System.Text;
using System.Text.Json.Nodes;
using System.Threading;
using System.Threading.Tasks;
using Virtufin.Worker.DevKit;

namespace WorkManager.DotNet
{
    public static class Host
    {
        const char Sep = '\0';
        const string DevKitName = "Virtufin.Worker.DevKit";
        const string RuntimeBinderName = "Microsoft.CSharp";
        const string ProbeMethod = "ProbeAsync";
        static byte[] runtimeBinder;
        static readonly object gate = new object();
        static readonly Dictionary<int, Slot> slots = new Dictionary<int, Slot>();
        static readonly Dictionary<long, Pending> pending = new Dictionary<long, Pending>();
        static readonly List<WeakReference> unloaded = new List<WeakReference>();
        static int nextSlot;
        static long nextCall;
        static Assembly devKit;

        // -- start -------------------------------------------------------------------------

        /// <summary>Once per process, after the DevKit and this assembly are loaded: worker
        /// references to the DevKit resolve to the loaded copy, and pythonnet's assembly
        /// hook no longer sees collectible assemblies (it keeps every assembly it sees).</summary>
        public static string Init()
        {
            devKit = typeof(IWorker).Assembly;
            AppDomain.CurrentDomain.AssemblyResolve += ResolveDevKit;
            return FilterPythonnetHook();
        }

        static Assembly ResolveDevKit(object sender, ResolveEventArgs args)
        {
            return new AssemblyName(args.Name).Name == DevKitName ? devKit : null;
        }

        static string FilterPythonnetHook()
        {
            foreach (Assembly assembly in AppDomain.CurrentDomain.GetAssemblies())
            {
                if (assembly.GetName().Name != "Python.Runtime") continue;
                Type manager = assembly.GetType("Python.Runtime.AssemblyManager");
                FieldInfo field = manager == null ? null : manager.GetField(
                    "lhandler", BindingFlags.Static | BindingFlags.NonPublic | BindingFlags.Public);
                AssemblyLoadEventHandler original = field == null ? null
                    : field.GetValue(null) as AssemblyLoadEventHandler;
                if (original == null) return "pythonnet's AssemblyManager.lhandler was not found";
                AppDomain.CurrentDomain.AssemblyLoad -= original;
                AssemblyLoadEventHandler filtered = (sender, e) =>
                {
                    if (!IsCollectible(e.LoadedAssembly)) original(sender, e);
                };
                field.SetValue(null, filtered);
                AppDomain.CurrentDomain.AssemblyLoad += filtered;
                return "";
            }
            return "Python.Runtime is not loaded";
        }

        static readonly PropertyInfo isCollectible = typeof(Assembly).GetProperty("IsCollectible");

        static bool IsCollectible(Assembly assembly)
        {
            return isCollectible != null && (bool)isCollectible.GetValue(assembly);
        }

        /// <summary>Installs the hooks the DevKit calls: Python callables wrapped as delegates.</summary>
        public static void SetHooks(Action<string, string, string> log,
                                    Func<string, string, int, string, string, string, long, string> gateway)
        {
            WorkerHost.LogHook = log;
            WorkerHost.GatewayHook = gateway;
        }

        // -- contexts ----------------------------------------------------------------------

        sealed class Slot
        {
            public string WorkerId;
            public object Context;
            public IWorker Worker;
            public Func<Task<bool>> Probe;
            public int Busy;
            public bool Retired;
        }

        sealed class Pending
        {
            public Slot Slot;
            public Task Task;
            public Func<string> Finish;
        }

        static readonly Type contextType = Type.GetType(
            "System.Runtime.Loader.AssemblyLoadContext, System.Runtime.Loader", true);

        /// <summary>Loads <paramref name="mainFile"/> (and, on demand, the other *.dll files of
        /// <paramref name="directory"/>) into a new collectible AssemblyLoadContext, and
        /// creates its one IWorker. "ok\0handle\0worker type" or "error\0message". The files
        /// are read into memory: the directory may be deleted afterwards.</summary>
        public static string Load(string workerId, string directory, string mainFile)
        {
            object context = Activator.CreateInstance(contextType, new object[] { "wm-worker-" + workerId, true });
            var dependencies = new Dependencies(context, directory);
            EventInfo resolving = contextType.GetEvent("Resolving");
            resolving.AddEventHandler(context, Delegate.CreateDelegate(
                resolving.EventHandlerType, dependencies, typeof(Dependencies).GetMethod("Resolve")));
            IWorker worker = null;
            Func<Task<bool>> probe = null;
            string answer;
            try
            {
                Assembly assembly = dependencies.Load(Path.GetFileNameWithoutExtension(mainFile));
                foreach (AssemblyName reference in assembly.GetReferencedAssemblies())
                    if (reference.Name == RuntimeBinderName) dependencies.LoadRuntimeBinder();
                Type type = FindWorkerType(assembly);
                MethodInfo probeMethod = FindProbe(type);
                worker = (IWorker)Activator.CreateInstance(type);
                if (probeMethod != null)
                    probe = (Func<Task<bool>>)Delegate.CreateDelegate(typeof(Func<Task<bool>>), worker, probeMethod);
                answer = type.FullName;
            }
            catch (Exception e)
            {
                Unload(context);
                Exception cause = e is TargetInvocationException && e.InnerException != null ? e.InnerException : e;
                return "error" + Sep + Describe(cause);
            }
            lock (gate)
            {
                int handle = ++nextSlot;
                slots[handle] = new Slot { WorkerId = workerId, Context = context, Worker = worker, Probe = probe };
                return "ok" + Sep + handle + Sep + answer;
            }
        }

        sealed class Dependencies
        {
            readonly object context;
            readonly Dictionary<string, byte[]> files = new Dictionary<string, byte[]>(StringComparer.OrdinalIgnoreCase);
            readonly MethodInfo loadFromStream;

            public Dependencies(object context, string directory)
            {
                this.context = context;
                foreach (string path in Directory.GetFiles(directory, "*.dll"))
                    files[Path.GetFileNameWithoutExtension(path)] = File.ReadAllBytes(path);
                loadFromStream = contextType.GetMethod("LoadFromStream", new[] { typeof(Stream) });
            }

            /// <summary>A private copy of the C# runtime binder (what <c>dynamic</c>, as in
            /// <c>Api.Gateway</c>, runs on): the shared one caches every binder it makes, with
            /// the worker's types in them, process-wide, so a context whose code used
            /// <c>dynamic</c> could never be collected (dotnet/runtime#71629, fixed after
            /// .NET 8). Bound first, the copy is what the worker's references resolve to,
            /// and its caches go with the context.</summary>
            public void LoadRuntimeBinder()
            {
                if (runtimeBinder == null)
                    runtimeBinder = File.ReadAllBytes(typeof(Microsoft.CSharp.RuntimeBinder.Binder).Assembly.Location);
                using (var stream = new MemoryStream(runtimeBinder, false))
                    loadFromStream.Invoke(context, new object[] { stream });
            }

            public Assembly Load(string name)
            {
                using (var stream = new MemoryStream(files[name], false))
                    return (Assembly)loadFromStream.Invoke(context, new object[] { stream });
            }

            // Resolving(AssemblyLoadContext, AssemblyName): a sibling dependency of the
            // worker; the DevKit and the framework come from the default context first.
            public Assembly Resolve(object sender, AssemblyName name)
            {
                if (name.Name == DevKitName) return devKit;
                return files.ContainsKey(name.Name) ? Load(name.Name) : null;
            }
        }

        static Type FindWorkerType(Assembly assembly)
        {
            Type[] types;
            try { types = assembly.GetTypes(); }
            catch (ReflectionTypeLoadException e)
            {
                var missing = new StringBuilder();
                foreach (Exception inner in e.LoaderExceptions)
                    if (inner != null) missing.Append(" ").Append(inner.Message);
                throw new InvalidOperationException("the assembly's types cannot be loaded:" + missing);
            }
            var found = new List<Type>();
            foreach (Type type in types)
                if (typeof(IWorker).IsAssignableFrom(type) && type.IsClass && !type.IsAbstract && !type.ContainsGenericParameters)
                    found.Add(type);
            if (found.Count == 0)
                throw new InvalidOperationException(
                    "no class in " + assembly.GetName().Name + " implements " + typeof(IWorker).FullName
                    + "; a worker assembly has exactly one");
            if (found.Count > 1)
            {
                var names = new List<string>();
                foreach (Type type in found) names.Add(type.FullName);
                throw new InvalidOperationException(
                    found.Count + " classes implement " + typeof(IWorker).FullName + " (" + string.Join(", ", names)
                    + "); a worker assembly has exactly one");
            }
            if (found[0].GetConstructor(Type.EmptyTypes) == null)
                throw new InvalidOperationException(found[0].FullName + " has no public parameterless constructor");
            return found[0];
        }

        /// <summary>The worker's health probe: its public <c>Task&lt;bool&gt; ProbeAsync()</c>, or
        /// null when it has none (WorkerBase's own, not overridden, is none). A method of that
        /// name in another shape is refused: it was surely meant as the probe.</summary>
        static MethodInfo FindProbe(Type type)
        {
            MethodInfo probe = type.GetMethod(
                ProbeMethod, BindingFlags.Public | BindingFlags.Instance, null, Type.EmptyTypes, null);
            if (probe != null && probe.DeclaringType == typeof(WorkerBase)) return null;
            if (probe != null && probe.ReturnType == typeof(Task<bool>)) return probe;
            BindingFlags any = BindingFlags.Public | BindingFlags.NonPublic | BindingFlags.Instance | BindingFlags.Static;
            if (probe == null && type.GetMember(ProbeMethod, MemberTypes.Method, any).Length == 0) return null;
            throw new InvalidOperationException(
                type.FullName + "." + ProbeMethod + " is no health probe: declare it as "
                + "public Task<bool> " + ProbeMethod + "() (override it on WorkerBase)");
        }

        /// <summary>Unloads the context once no call is running in it (at once when idle).</summary>
        public static void Unload(int handle)
        {
            Slot slot;
            lock (gate)
            {
                if (!slots.TryGetValue(handle, out slot)) return;
                slots.Remove(handle);
                slot.Retired = true;
                if (slot.Busy > 0) return;  // the last call to finish unloads it
            }
            Retire(slot);
        }

        static void Retire(Slot slot)
        {
            object context = slot.Context;
            slot.Worker = null;
            slot.Probe = null;
            slot.Context = null;
            Unload(context);
        }

        static void Unload(object context)
        {
            contextType.GetMethod("Unload").Invoke(context, null);
            lock (gate) unloaded.Add(new WeakReference(context));
        }

        /// <summary>Collects garbage until the unloaded contexts are gone or
        /// <paramref name="rounds"/> passed; the names of those still alive.</summary>
        public static string[] CollectUnloaded(int rounds)
        {
            for (int i = 0; ; i++)
            {
                GC.Collect();
                GC.WaitForPendingFinalizers();
                lock (gate)
                {
                    unloaded.RemoveAll(reference => !reference.IsAlive);
                    if (unloaded.Count == 0 || i + 1 >= rounds)
                    {
                        var names = new List<string>();
                        foreach (WeakReference reference in unloaded)
                        {
                            object context = reference.Target;
                            if (context != null) names.Add(context.ToString());
                        }
                        return names.ToArray();
                    }
                }
            }
        }

        /// <summary>Contexts loaded and not unloaded.</summary>
        public static int Loaded() { lock (gate) return slots.Count; }

        // -- calls -------------------------------------------------------------------------

        /// <summary>Starts ProcessAsync. The answer ("ok…", "none", "error…") when the task
        /// completed synchronously, else "pending\0call" to <see cref="Wait"/> for.</summary>
        static string Process(int handle, string header, string data, long timeoutMs)
        {
            Slot slot = Enter(handle);
            if (slot == null) return NoWorker(handle);
            return Start<CloudEvent>(slot, timeoutMs, "ProcessAsync",
                                     () => slot.Worker.ProcessAsync(Decode(header, data)), EventAnswer);
        }

        /// <summary><see cref="Process"/> called through a function pointer, which costs a
        /// fraction of a call through pythonnet: the header and data as UTF-8 bytes, the
        /// answer written as UTF-8 into the caller's buffer of <c>capacity</c> bytes. Returns
        /// the answer's length, or minus it when it does not fit: then
        /// <see cref="TakeAnswer"/> gives it, as a string, to the same thread.</summary>
        [UnmanagedFunctionPointer(CallingConvention.Cdecl)]
        public delegate int ProcessCall(int handle, IntPtr header, int headerLength, IntPtr data,
                                        int dataLength, long timeoutMs, IntPtr answer, int capacity);

        static readonly ProcessCall processCall = ProcessBytes;  // the pointer lives as long
        const int ScratchKept = 64 * 1024;
        [ThreadStatic] static byte[] scratch;
        [ThreadStatic] static string spilled;

        /// <summary>The address of <see cref="ProcessCall"/>'s entry.</summary>
        public static long ProcessEntry() { return Marshal.GetFunctionPointerForDelegate(processCall).ToInt64(); }

        static int ProcessBytes(int handle, IntPtr header, int headerLength, IntPtr data,
                                int dataLength, long timeoutMs, IntPtr answer, int capacity)
        {
            string text;
            try
            {
                text = Process(handle, Utf8(header, headerLength), Utf8(data, dataLength), timeoutMs);
            }
            catch (Exception e)  // nothing may unwind into the caller's native frames
            {
                text = Failure(e);
            }
            int length = Encoding.UTF8.GetByteCount(text);
            if (length > capacity)
            {
                spilled = text;
                return -length;
            }
            byte[] bytes = Scratch(length);
            Encoding.UTF8.GetBytes(text, 0, text.Length, bytes, 0);
            Marshal.Copy(bytes, 0, answer, length);
            return length;
        }

        /// <summary>The last answer of this thread's <see cref="ProcessCall"/> that did not
        /// fit its buffer.</summary>
        public static string TakeAnswer()
        {
            string text = spilled;
            spilled = null;
            return text;
        }

        static string Utf8(IntPtr bytes, int length)
        {
            if (length == 0) return "";
            byte[] buffer = Scratch(length);
            Marshal.Copy(bytes, buffer, 0, length);
            return Encoding.UTF8.GetString(buffer, 0, length);
        }

        /// <summary>This thread's buffer of at least <paramref name="length"/> bytes; one
        /// beyond <see cref="ScratchKept"/> is not kept (a large event's would stay).</summary>
        static byte[] Scratch(int length)
        {
            if (length > ScratchKept) return new byte[length];
            if (scratch == null || scratch.Length < length) scratch = new byte[Math.Max(length, 4096)];
            return scratch;
        }

        /// <summary>Starts the worker's health probe. "noprobe" when it has none, else as
        /// <see cref="Process"/> with the answers "healthy" and "unhealthy".</summary>
        public static string Probe(int handle, long timeoutMs)
        {
            Slot slot = Enter(handle);
            if (slot == null) return NoWorker(handle);
            Func<Task<bool>> probe = slot.Probe;
            if (probe == null)
            {
                Done(slot);
                return "noprobe";
            }
            return Start<bool>(slot, timeoutMs, ProbeMethod, probe, ProbeAnswer);
        }

        static Slot Enter(int handle)
        {
            Slot slot;
            lock (gate)
            {
                if (!slots.TryGetValue(handle, out slot)) return null;
                slot.Busy++;
                return slot;
            }
        }

        static string NoWorker(int handle)
        {
            return "error" + Sep + "WorkManager.DotNet.NoWorker" + Sep + "no worker is loaded with handle " + handle;
        }

        static string EventAnswer(CloudEvent output) { return output == null ? "none" : Encode(output); }

        static string ProbeAnswer(bool healthy) { return healthy ? "healthy" : "unhealthy"; }

        /// <summary>Runs <paramref name="begin"/> as the slot's worker, within its time limit
        /// (for gateway calls); the answer, or "pending\0call" for an unfinished task.</summary>
        static string Start<T>(Slot slot, long timeoutMs, string method, Func<Task<T>> begin, Func<T, string> answer)
        {
            Task<T> task;
            try
            {
                long deadline = DateTime.UtcNow.Ticks + timeoutMs * TimeSpan.TicksPerMillisecond;
                WorkerHost.Current.Value = new WorkerHost.Call(slot.WorkerId, deadline);
                task = begin();
                if (task == null) throw new InvalidOperationException(method + " returned a null Task");
            }
            catch (Exception e)
            {
                Done(slot);
                return Failure(e);
            }
            finally
            {
                WorkerHost.Current.Value = null;
            }
            Func<string> finish = () => Finish(slot, task, method, answer);
            if (task.IsCompleted) return finish();
            lock (gate)
            {
                long call = ++nextCall;
                pending[call] = new Pending { Slot = slot, Task = task, Finish = finish };
                return "pending" + Sep + call;
            }
        }

        /// <summary>Waits up to <paramref name="timeoutMs"/> for a pending call: its answer,
        /// or "timeout" (the call stays pending; <see cref="Abandon"/> it).</summary>
        public static string Wait(long call, int timeoutMs)
        {
            Pending entry;
            lock (gate)
            {
                if (!pending.TryGetValue(call, out entry))
                    return "error" + Sep + "WorkManager.DotNet.NoCall" + Sep + "no pending call " + call;
            }
            try { if (!entry.Task.Wait(timeoutMs)) return "timeout"; }
            catch (AggregateException) { }
            lock (gate) pending.Remove(call);
            return entry.Finish();
        }

        /// <summary>Gives up on a pending call: its answer is dropped when it completes, and
        /// its context is unloaded then if it was retired meanwhile.</summary>
        public static void Abandon(long call)
        {
            Pending entry;
            lock (gate)
            {
                if (!pending.TryGetValue(call, out entry)) return;
                pending.Remove(call);
            }
            entry.Task.ContinueWith(done => Done(entry.Slot), TaskContinuationOptions.ExecuteSynchronously);
        }

        static void Done(Slot slot)
        {
            bool retire;
            lock (gate)
            {
                slot.Busy--;
                retire = slot.Retired && slot.Busy == 0 && slot.Context != null;
            }
            if (retire) Retire(slot);
        }

        static string Finish<T>(Slot slot, Task<T> task, string method, Func<T, string> answer)
        {
            try
            {
                if (task.IsFaulted)
                {
                    Exception e = task.Exception.InnerExceptions.Count == 1 ? task.Exception.InnerException : task.Exception;
                    return Failure(e);
                }
                if (task.IsCanceled)
                    return "error" + Sep + "System.Threading.Tasks.TaskCanceledException" + Sep + method + " was canceled";
                return answer(task.Result);
            }
            catch (Exception e)
            {
                return Failure(e);
            }
            finally
            {
                Done(slot);
            }
        }

        static string Failure(Exception e)
        {
            return "error" + Sep + e.GetType().FullName + Sep + Describe(e);
        }

        static string Describe(Exception e)
        {
            var text = new StringBuilder(e.Message);
            for (Exception inner = e.InnerException; inner != null; inner = inner.InnerException)
                text.Append(" (").Append(inner.GetType().FullName).Append(": ").Append(inner.Message).Append(")");
            return text.ToString();
        }

        // -- the wire between Python and here -------------------------------------------
        // header: id, source, type, subject, datacontenttype, time, data kind, then
        // extension names and values; fields end with \0. Data kinds: j JSON text, t text,
        // b base64, n none. Empty subject/datacontenttype/time mean absent. A time of '@'
        // and digits is a UTC instant in microseconds since the Unix epoch.

        const char UtcMark = '@';

        static CloudEvent Decode(string header, string data)
        {
            string[] f = header.Split(Sep);
            var input = new CloudEvent(f[0])
            {
                Source = f[1],
                Type = f[2],
                Subject = f[3].Length == 0 ? null : f[3],
                DataContentType = f[4].Length == 0 ? null : f[4],
            };
            string time = f[5];
            if (time.Length > 0 && time[0] == UtcMark)
                input.SetUtcTime(long.Parse(time.Substring(1), NumberStyles.AllowLeadingSign, CultureInfo.InvariantCulture));
            else if (time.Length > 0)
                input.Time = time;
            switch (f[6])
            {
                case "j": input.Data = JsonNode.Parse(data); break;
                case "t": input.Data = data; break;
                case "b": input.Data = Convert.FromBase64String(data); break;
                default: input.Data = null; break;
            }
            for (int i = 7; i + 1 < f.Length; i += 2) input[f[i]] = f[i + 1];
            return input;
        }

        // "ok\0" + id, source, type, subject, datacontenttype, time, data kind, error flag ("1",
        // or the .NET type of the exception answered),
        // error message, extension count, names and values, then the data (last: it may
        // hold \0).
        static string Encode(CloudEvent output)
        {
            string kind, body;
            object data = output.Data;
            if (data == null) { kind = "n"; body = ""; }
            else if (data is string) { kind = "t"; body = (string)data; }
            else if (data is byte[]) { kind = "b"; body = Convert.ToBase64String((byte[])data); }
            else { kind = "j"; body = Json.Serialize(data); }
            var text = new StringBuilder(128 + body.Length);
            text.Append("ok");
            foreach (string field in new[] { output.Id, output.Source, output.Type, output.Subject,
                                             output.DataContentType, output.Time, kind,
                                             output.AnsweredError == null ? "" : output.AnsweredErrorType ?? "1",
                                             output.AnsweredError ?? "",
                                             output.Extensions.Count.ToString() })
                text.Append(Sep).Append(field ?? "");
            foreach (KeyValuePair<string, string> extension in output.Extensions)
                text.Append(Sep).Append(extension.Key).Append(Sep).Append(extension.Value ?? "");
            return text.Append(Sep).Append(body).ToString();
        }
    }
}
