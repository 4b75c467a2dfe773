// The evaluator's op monitor: a RecordFunction callback on every thread that sees each operator a
// candidate's forward dispatches and remembers the first one outside the allowlist. Built by the
// harness against the running torch (never by a candidate) and driven from hpc/runner/op_monitor.py.
//
// A callback that is not called sees nothing: a forward that cleared torch's callbacks or switched
// RecordFunction off on its thread would look clean. So disarm records a canary while still armed,
// through the gate the dispatcher passes for every operator, and a canary the callback did not see
// makes the call's verdict kDisabled.
#include <ATen/record_function.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_set>

namespace {

std::deque<std::string> names;                       // owns the strings the sets view
std::unordered_set<std::string_view> allowed_ops;    // "aten::view": every overload allowed
std::unordered_set<std::string_view> allowed_overloads;  // "aten::to.dtype": that overload only
std::atomic<bool> armed{false};
std::atomic<long> seen{0};
std::atomic<long> violations{0};
std::atomic<long> last_verdict{0};
std::mutex first_mutex;
std::string first;
bool installed = false;

// The operators an allowlisted operator calls inside its own kernel (relu's cpu kernel calls
// clamp_min) are its implementation, not the candidate's: they are not checked. An operator
// allowed only because it decomposes gets no such pass, so linear's matmul is still checked.
thread_local int inside_allowed = 0;

// Set only around disarm's own canary call, on disarm's thread: other threads' operators stay checked.
thread_local bool canary_running = false;
std::atomic<bool> canary_seen{false};
constexpr long kDisabled = -1;

struct Allowed : at::ObserverContext {};

enum class Verdict { allowed_with_children, allowed, violation };

// Only dispatcher operators are checked: other records of the FUNCTION scope are torch's own
// labels (e.g. "PythonDispatchMode" when the poison fill's dispatch mode runs), never work.
Verdict verdict(const at::RecordFunction& fn) {
  auto op = fn.operator_name();
  if (!op) return Verdict::allowed;
  if (allowed_ops.count(op->name)) return Verdict::allowed_with_children;
  const bool decomposes = op->overload_name.empty()
      ? allowed_overloads.count(op->name) > 0
      : allowed_overloads.count(op->name + "." + op->overload_name) > 0;
  return decomposes ? Verdict::allowed : Verdict::violation;
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  if (!armed.load(std::memory_order_acquire)) return nullptr;
  if (canary_running) {
    canary_seen.store(true, std::memory_order_relaxed);
    return nullptr;
  }
  seen.fetch_add(1, std::memory_order_relaxed);
  if (inside_allowed > 0) return nullptr;
  switch (verdict(fn)) {
    case Verdict::allowed_with_children:
      ++inside_allowed;
      return std::make_unique<Allowed>();
    case Verdict::allowed:
      return nullptr;
    case Verdict::violation:
      if (violations.fetch_add(1) == 0) {
        std::lock_guard<std::mutex> lock(first_mutex);
        first = fn.name();
      }
      return nullptr;
  }
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext* ctx) {
  if (ctx) --inside_allowed;
}

void add_lines(const char* text, std::unordered_set<std::string_view>& into) {
  for (const char* p = text; *p;) {
    const char* end = std::strchr(p, '\n');
    size_t n = end ? size_t(end - p) : std::strlen(p);
    if (n) into.insert(names.emplace_back(p, n));
    p += n + (end ? 1 : 0);
  }
}

// A FUNCTION-scope record on the calling thread, gated as Dispatcher::call gates each operator's:
// by torch's global and thread-local callbacks and the thread's RecordFunction switch.
bool canary_is_seen() {
  canary_seen.store(false, std::memory_order_relaxed);
  canary_running = true;
  try {
    auto step = at::getStepCallbacksUnlessEmpty(at::RecordScope::FUNCTION);
    if (step) {
      at::RecordFunction canary(std::move(*step));
      canary.before("hpc::canary");
    }
  } catch (...) {
    canary_seen.store(false, std::memory_order_relaxed);
  }
  canary_running = false;
  return canary_seen.load(std::memory_order_relaxed);
}

}  // namespace

// Replaces the allowlist: newline-separated operator names (all overloads) and overload names.
extern "C" int hpc_op_monitor_allow(const char* ops, const char* overloads) {
  if (armed.load()) return 1;
  allowed_ops.clear();
  allowed_overloads.clear();
  names.clear();
  add_lines(ops, allowed_ops);
  add_lines(overloads, allowed_overloads);
  if (!installed) {
    at::addGlobalCallback(at::RecordFunctionCallback(on_start, on_end).scopes({at::RecordScope::FUNCTION}));
    installed = true;
  }
  return 0;
}

extern "C" void hpc_op_monitor_arm() {
  seen.store(0);
  violations.store(0);
  armed.store(true, std::memory_order_release);
}

// Stops watching; returns how many operators outside the allowlist ran since arm, or kDisabled when
// the monitor was not seeing operators at the end of the call. Disarmed already: the last verdict.
extern "C" long hpc_op_monitor_disarm() {
  if (!armed.load(std::memory_order_acquire)) return last_verdict.load();
  const bool seeing = canary_is_seen();
  armed.store(false, std::memory_order_release);
  last_verdict.store(seeing ? violations.load() : kDisabled);
  return last_verdict.load();
}

extern "C" long hpc_op_monitor_seen() { return seen.load(); }

// The first operator outside the allowlist since arm, copied into `out` (at most `size` bytes).
extern "C" void hpc_op_monitor_first(char* out, size_t size) {
  std::lock_guard<std::mutex> lock(first_mutex);
  std::snprintf(out, size, "%s", first.c_str());
}
