// Small pieces every part of voxserve-frontend uses: the log, the clocks, and a reader for the engine's hello
// (a flat JSON object).
#pragma once

#include <cstdint>
#include <map>
#include <string>

namespace voxserve {

// This front end's name (--name), put at the start of every log line.
void SetLogName(const std::string& name);

// One line on stderr: "voxserve-frontend NAME: message". stderr is unbuffered, and each line is written with one
// call, so lines of different threads do not interleave.
void Log(const char* format, ...) __attribute__((format(printf, 1, 2)));

// CLOCK_MONOTONIC, which Python's time.monotonic() reads on Linux: the engine compares the deadlines of the
// records with it.
double MonotonicSeconds();
int64_t MonotonicNs();

// A flat JSON object (what json.dumps makes of a dict of strings, numbers, booleans and nulls): each key with its
// value as text (strings unescaped, others as written). Throws std::runtime_error on anything else.
std::map<std::string, std::string> ParseFlatJson(const std::string& text);

// ``text`` as a JSON string literal, quotes included.
std::string JsonString(const std::string& text);

}  // namespace voxserve
