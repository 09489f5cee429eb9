// worker.cpp - the example native worker in C++17, on the flatc-generated
// generated/cpp/worker_api_generated.h and the FlatBuffers C++ library (see GUIDE.md).
//
// The behaviour of examples/c/worker.c, by the input event's subject: any other answers
// <type>.processed from /native/cpp-example with the data upper-cased; "gateway" answers the
// response of echo.ping; "fail" answers an error_message; "rc" returns VIRTUFIN_ERR_INTERNAL.
//
// The answer is built in a FlatBufferBuilder and copied into one malloc'ed block, so
// FreeResult is free(). No exception crosses the C ABI. Reentrant: the only global is the
// identity, initialized while the library loads.

#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <string>
#include <vector>

#include "virtufin_worker_api.h"
#include "worker_api_generated.h"

namespace {

namespace vw = virtufin::worker;

// VIRTUFIN_WORKER_ID, read by a namespace-scope initializer, which runs inside dlopen: the
// engine sets the variable before loading this copy of the library, and another worker loaded
// later in the same process changes it (a function-local static would read it too late).
const std::string kWorkerId = [] {
    const char* id = std::getenv("VIRTUFIN_WORKER_ID");
    return std::string(id ? id : "unknown");
}();

// What an answer carries besides the input's identity.
struct Body {
    std::optional<std::string> data;
    std::optional<std::string> content_type;
};

int32_t hand_out(const flatbuffers::FlatBufferBuilder& fbb, uint8_t** out_buf, int32_t* out_len) {
    auto* buf = static_cast<uint8_t*>(std::malloc(fbb.GetSize()));
    if (buf == nullptr) return VIRTUFIN_ERR_OUT_OF_MEMORY;
    std::memcpy(buf, fbb.GetBufferPointer(), fbb.GetSize());
    *out_buf = buf;
    *out_len = static_cast<int32_t>(fbb.GetSize());
    return VIRTUFIN_OK;
}

int32_t error(const std::string& message, uint8_t** out_buf, int32_t* out_len) {
    flatbuffers::FlatBufferBuilder fbb;
    auto text = fbb.CreateString(message);
    fbb.Finish(vw::CreateWorkerResponse(fbb, 0, text));
    return hand_out(fbb, out_buf, out_len);
}

// The extensions of an answer: correlationid (when the input has one), workerid, engine.
std::vector<flatbuffers::Offset<vw::Extension>> extensions(flatbuffers::FlatBufferBuilder& fbb,
                                                          const vw::CloudEvent& in) {
    std::vector<flatbuffers::Offset<vw::Extension>> out;
    auto add = [&](const char* key, const std::string& value) {
        out.push_back(vw::CreateExtension(fbb, fbb.CreateString(key), fbb.CreateString(value)));
    };
    const vw::Extension* correlation =
        in.extensions() ? in.extensions()->LookupByKey("correlationid") : nullptr;
    if (correlation != nullptr && correlation->value() != nullptr)
        add("correlationid", correlation->value()->str());
    add("workerid", kWorkerId);
    add("engine", "cpp");
    return out;
}

int32_t answer(const vw::CloudEvent& in, const Body& body, uint8_t** out_buf, int32_t* out_len) {
    flatbuffers::FlatBufferBuilder fbb;
    auto id = fbb.CreateString(in.id());
    auto source = fbb.CreateString("/native/cpp-example");
    auto type = fbb.CreateString(in.type()->str() + ".processed");
    auto specversion = fbb.CreateString("1.0");
    flatbuffers::Offset<flatbuffers::String> content_type;
    if (body.content_type) content_type = fbb.CreateString(*body.content_type);
    flatbuffers::Offset<flatbuffers::Vector<uint8_t>> data;
    if (body.data)
        data = fbb.CreateVector(reinterpret_cast<const uint8_t*>(body.data->data()),
                                body.data->size());
    auto ext = extensions(fbb, in);
    auto sorted = fbb.CreateVectorOfSortedTables(&ext);
    auto event = vw::CreateCloudEvent(fbb, id, source, type, specversion, content_type, 0, 0,
                                      data, sorted);
    fbb.Finish(vw::CreateWorkerResponse(fbb, event));
    return hand_out(fbb, out_buf, out_len);
}

std::optional<std::string> upper_case(const flatbuffers::Vector<uint8_t>* data) {
    if (data == nullptr) return std::nullopt;
    std::string text(reinterpret_cast<const char*>(data->data()), data->size());
    for (char& c : text)
        if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
    return text;
}

int32_t call_gateway(const VirtufinHost& host, const vw::CloudEvent& in, uint8_t** out_buf,
                     int32_t* out_len) {
    uint8_t* raw = nullptr;
    int32_t raw_len = 0;
    const auto* data = in.data();
    int32_t status = host.gateway_call("echo", "ping", data ? data->data() : nullptr,
                                       data ? static_cast<int32_t>(data->size()) : 0, &raw,
                                       &raw_len);
    auto release = [&host](uint8_t* p) { host.free_response(p); };
    std::unique_ptr<uint8_t, decltype(release)> response(raw, release);
    std::string text;
    if (raw != nullptr && raw_len > 0) text.assign(reinterpret_cast<const char*>(raw), raw_len);
    if (status != VIRTUFIN_GATEWAY_OK)
        return error("gateway call failed: " + text, out_buf, out_len);
    return answer(in, Body{text, "application/json"}, out_buf, out_len);
}

int32_t process(const VirtufinHost& host, const uint8_t* in_buf, int32_t in_len,
                uint8_t** out_buf, int32_t* out_len) {
    if (in_buf == nullptr || in_len < 0 ||
        static_cast<uint64_t>(in_len) >= FLATBUFFERS_MAX_BUFFER_SIZE)
        return VIRTUFIN_ERR_INVALID_INPUT;
    flatbuffers::Verifier verifier(in_buf, static_cast<size_t>(in_len));
    if (!verifier.VerifyBuffer<vw::CloudEvent>(nullptr)) {
        host.log(VIRTUFIN_LOG_WARN, "not a CloudEvent");
        return VIRTUFIN_ERR_INVALID_INPUT;
    }
    const auto* in = flatbuffers::GetRoot<vw::CloudEvent>(in_buf);
    host.log(VIRTUFIN_LOG_INFO, ("processing " + in->id()->str()).c_str());
    const std::string subject = in->subject() ? in->subject()->str() : "";
    if (subject == "rc") return VIRTUFIN_ERR_INTERNAL;
    if (subject == "fail") return error("asked to fail", out_buf, out_len);
    if (subject == "gateway") return call_gateway(host, *in, out_buf, out_len);
    std::optional<std::string> content_type;
    if (in->datacontenttype()) content_type = in->datacontenttype()->str();
    return answer(*in, Body{upper_case(in->data()), content_type}, out_buf, out_len);
}

}  // namespace

int32_t Process(const VirtufinHost* host, const uint8_t* in_buf, int32_t in_len,
                uint8_t** out_buf, int32_t* out_len) {
    *out_buf = nullptr;
    *out_len = 0;
    try {
        return process(*host, in_buf, in_len, out_buf, out_len);
    } catch (const std::bad_alloc&) {
        return VIRTUFIN_ERR_OUT_OF_MEMORY;
    } catch (...) {
        return VIRTUFIN_ERR_INTERNAL;
    }
}

void FreeResult(uint8_t* out_buf) {
    std::free(out_buf);
}
