// Prints whether each file named on the command line is a valid WorkerResponse, by the
// official FlatBuffers verifier (built and run by test_native_abi).
#include <cstdio>
#include <fstream>
#include <iterator>
#include <vector>
#include "worker_api_generated.h"

int main(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        std::ifstream file(argv[i], std::ios::binary);
        std::vector<uint8_t> buf((std::istreambuf_iterator<char>(file)),
                                 std::istreambuf_iterator<char>());
        flatbuffers::Verifier verifier(buf.data(), buf.size());
        bool ok = virtufin::worker::VerifyWorkerResponseBuffer(verifier);
        std::printf("%s %s\n", argv[i], ok ? "valid" : "invalid");
    }
    return 0;
}
