// Weight-streaming engine: checkpoint tensors held in (pinned) host memory, a ring of fixed-address device slots,
// asynchronous host-to-device copies on a dedicated stream with events, and the guards that
// docs/lessons.md#no-silent-wrong-output asks for:
//   - MissingSlot:       a host tensor (or a whole layer) asked for with no device slot holding it;
//   - ByteSizeMismatch:  a copy whose source and destination byte sizes differ (checked before every copy);
//   - ShortSlotMap:      a layer's slot map that does not cover every tensor of the layer;
//   - SlotMap:           a malformed slot map (misaligned, overlapping, past the end of the slot);
//   - SlotBusy:          a fetch that would overwrite a slot a kernel may still read;
//   - NotPinned / NotHost: a host tensor that cannot be streamed asynchronously.
// Each kind is raised as the Python class registered for it (shard_svc/weight_streaming/errors.py).
//
// One build serves both devices, chosen per engine at run time:
//  - cpu:  slots are host buffers, a worker thread plays the copy stream, a job number plays the event;
//  - cuda: asynchronous host-to-device copies (cuMemcpyHtoDAsync) on a dedicated copy stream, events for "slot
//          ready" (copy stream -> compute stream) and "slot released" (compute stream -> copy stream).
// The CUDA driver API is resolved at run time from libcuda.so.1, which every machine with an NVIDIA driver has: the
// build needs no CUDA toolkit, headers or nvcc, so the binary CI compiles on a CPU machine is the one a GPU runs.
// Streams come from torch (their `cuda_stream` handles: runtime streams are driver CUstreams). The API and every
// guard are the same for both devices.

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace py = pybind11;

namespace kimiserve {

constexpr int64_t kAlign = 256;  // every slot-map offset; any dtype view and vectorised load stays aligned

struct StreamError : std::runtime_error {
  std::string kind;
  StreamError(std::string k, const std::string& msg) : std::runtime_error(msg), kind(std::move(k)) {}
};

template <typename... Args>
[[noreturn]] void fail(const char* kind, Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  throw StreamError(kind, os.str());
}

// kind -> Python exception class; set once by the Python wrapper. Leaked on purpose (no destructor at exit).
static std::unordered_map<std::string, py::object>* g_errors = new std::unordered_map<std::string, py::object>();

// ---- the CUDA driver API, loaded on first use -------------------------------------------------------------------
using CUstream = void*;
using CUevent = void*;
using CUcontext = void*;
using CUresult = int;
constexpr unsigned kEventDisableTiming = 0x2;

struct CudaDriver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, int) = nullptr;
  CUresult (*ctx_get_current)(CUcontext*) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*ctx_get_device)(int*) = nullptr;
  CUresult (*memcpy_htod_async)(uint64_t, const void*, size_t, CUstream) = nullptr;
  CUresult (*event_create)(CUevent*, unsigned) = nullptr;
  CUresult (*event_destroy)(CUevent) = nullptr;
  CUresult (*event_record)(CUevent, CUstream) = nullptr;
  CUresult (*event_synchronize)(CUevent) = nullptr;
  CUresult (*event_elapsed)(float*, CUevent, CUevent) = nullptr;
  CUresult (*stream_wait_event)(CUstream, CUevent, unsigned) = nullptr;
  CUresult (*stream_synchronize)(CUstream) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  CUresult (*pointer_get_attribute)(void*, int, uint64_t) = nullptr;
};
constexpr int kPointerAttributeMemoryType = 2;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr unsigned kMemoryTypeHost = 1;         // CU_MEMORYTYPE_HOST: page-locked (cudaHostAlloc / cudaHostRegister)

template <typename F>
void resolve(void* lib, F& fn, std::initializer_list<const char*> names) {
  for (const char* name : names) {
    if (void* sym = dlsym(lib, name)) {
      fn = reinterpret_cast<F>(sym);
      return;
    }
  }
  fail("NativeBuild", "libcuda.so.1 has no ", *names.begin(), " (driver too old?)");
}

const CudaDriver& cuda_driver() {
  static CudaDriver d = [] {
    CudaDriver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) fail("NativeBuild", "cannot load libcuda.so.1 (the NVIDIA driver library): ", dlerror());
    resolve(lib, d.init, {"cuInit"});
    resolve(lib, d.device_get, {"cuDeviceGet"});
    resolve(lib, d.primary_ctx_retain, {"cuDevicePrimaryCtxRetain"});
    resolve(lib, d.ctx_get_current, {"cuCtxGetCurrent"});
    resolve(lib, d.ctx_set_current, {"cuCtxSetCurrent"});
    resolve(lib, d.ctx_get_device, {"cuCtxGetDevice"});
    resolve(lib, d.memcpy_htod_async, {"cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"});
    resolve(lib, d.event_create, {"cuEventCreate"});
    resolve(lib, d.event_destroy, {"cuEventDestroy_v2", "cuEventDestroy"});
    resolve(lib, d.event_record, {"cuEventRecord"});
    resolve(lib, d.event_synchronize, {"cuEventSynchronize"});
    resolve(lib, d.event_elapsed, {"cuEventElapsedTime_v2", "cuEventElapsedTime"});
    resolve(lib, d.stream_wait_event, {"cuStreamWaitEvent"});
    resolve(lib, d.stream_synchronize, {"cuStreamSynchronize"});
    resolve(lib, d.error_string, {"cuGetErrorString"});
    resolve(lib, d.pointer_get_attribute, {"cuPointerGetAttribute"});
    return d;
  }();
  return d;
}

void ck(CUresult r, const char* what) {
  if (r == 0) return;
  const char* msg = nullptr;
  cuda_driver().error_string(r, &msg);
  fail("Cuda", what, " failed: CUDA error ", r, " (", msg ? msg : "unknown", ")");
}

using Clock = std::chrono::steady_clock;
static double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

struct Entry {
  int64_t offset;
  int64_t nbytes;
};

struct Layer {
  std::vector<int64_t> members;  // host tensor ids that make up the layer
  bool has_map = false;
  std::unordered_map<int64_t, Entry> map;  // host tensor id -> region of the slot
};

enum class SlotState { Free, Loading, InUse };

struct Slot {
  at::Tensor buf;  // uint8 [slot_bytes], allocated once: its address never changes
  int64_t layer = -1;
  SlotState state = SlotState::Free;
  std::unordered_set<int64_t> valid;  // host tensor ids copied in during this occupancy
  uint64_t job = 0;                   // CPU build: the copy job whose completion makes the slot ready
  Clock::time_point acquired_at;
  CUevent ready = nullptr;     // cuda: recorded on the copy stream after the slot's copies
  CUevent released = nullptr;  // cuda: recorded on the compute stream after the last kernel that read the slot
  bool released_recorded = false;
};

struct CopyOp {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
};

class StreamEngine {
 public:
  StreamEngine(int64_t num_slots, int64_t slot_bytes, const std::string& device, int64_t copy_stream,
               int64_t demand_stream) {
    if (num_slots < 1) fail("SlotMap", "a ring needs at least one slot, got ", num_slots);
    if (slot_bytes < 1) fail("SlotMap", "slot size must be positive, got ", slot_bytes, " bytes");
    device_ = at::Device(device);
    slot_bytes_ = (slot_bytes + kAlign - 1) / kAlign * kAlign;
    cuda_ = device_.is_cuda();
    if (!cuda_ && !device_.is_cpu()) fail("NativeBuild", "weight streaming runs on cpu or cuda, not ", device);
    if (cuda_ && (copy_stream == 0 || demand_stream == 0 || copy_stream == demand_stream))
      fail("NativeBuild", "a CUDA engine needs two dedicated streams (copy ", copy_stream, ", demand ", demand_stream,
           "); the default stream would serialise copies with compute");
    slots_.resize(num_slots);
    for (auto& s : slots_) s.buf = at::empty({slot_bytes_}, at::TensorOptions().dtype(at::kByte).device(device_));
    if (cuda_) {
      copy_stream_ = reinterpret_cast<CUstream>(copy_stream);
      demand_stream_ = reinterpret_cast<CUstream>(demand_stream);
      ensure_context();
      for (auto& s : slots_) {
        ck(cuda_driver().event_create(&s.ready, kEventDisableTiming), "cuEventCreate");
        ck(cuda_driver().event_create(&s.released, kEventDisableTiming), "cuEventCreate");
      }
      return;
    }
    worker_ = std::thread([this] { work(); });
  }

  ~StreamEngine() {
    if (worker_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
      }
      cv_.notify_all();
      worker_.join();
    }
    if (cuda_) {
      const CudaDriver& d = cuda_driver();
      d.stream_synchronize(copy_stream_);
      d.stream_synchronize(demand_stream_);
      for (auto& s : slots_) {
        d.event_destroy(s.ready);
        d.event_destroy(s.released);
      }
      for (auto e : timing_pool_) d.event_destroy(e);
    }
  }

  int64_t num_slots() const { return static_cast<int64_t>(slots_.size()); }
  int64_t slot_bytes() const { return slot_bytes_; }
  bool is_cuda() const { return cuda_; }
  at::Tensor slot(int64_t s) const { return slots_.at(check_slot(s)).buf; }

  // ---- registration ------------------------------------------------------------------------------------------
  int64_t add_host(const at::Tensor& t, const std::string& name) {
    if (!t.device().is_cpu())
      fail("NotHost", "host tensor ", name, " is on ", t.device().str(), "; streamed tensors live in host memory");
    if (!t.is_contiguous()) fail("NotHost", "host tensor ", name, " is not contiguous");
    if (cuda_ && !page_locked(t))
      fail("NotPinned", "host tensor ", name, " (", t.nbytes(), " bytes) is in pageable memory; an asynchronous "
           "copy to ", device_.str(), " needs pinned memory");
    host_.push_back(t);
    names_.push_back(name);
    return static_cast<int64_t>(host_.size()) - 1;
  }

  void set_members(int64_t layer, const std::vector<int64_t>& ids) {
    for (auto id : ids) check_host(id);
    layers_[layer].members = ids;
  }

  void set_slot_map(int64_t layer, const std::vector<int64_t>& ids, const std::vector<int64_t>& offsets,
                    const std::vector<int64_t>& nbytes) {
    if (ids.size() != offsets.size() || ids.size() != nbytes.size())
      fail("SlotMap", "slot map of layer ", layer, ": ", ids.size(), " ids, ", offsets.size(), " offsets, ",
           nbytes.size(), " byte sizes");
    std::unordered_map<int64_t, Entry> map;
    std::vector<std::pair<int64_t, int64_t>> regions;  // (offset, id)
    for (size_t i = 0; i < ids.size(); ++i) {
      check_host(ids[i]);
      const int64_t off = offsets[i], n = nbytes[i];
      if (off < 0 || n < 0 || off % kAlign)
        fail("SlotMap", "slot map of layer ", layer, ": ", names_[ids[i]], " at offset ", off, " (", n,
             " bytes); offsets must be non-negative multiples of ", kAlign);
      if (off + n > slot_bytes_)
        fail("SlotMap", "slot map of layer ", layer, ": ", names_[ids[i]], " occupies bytes [", off, ", ", off + n,
             ") but a slot holds ", slot_bytes_, " bytes");
      if (!map.emplace(ids[i], Entry{off, n}).second)
        fail("SlotMap", "slot map of layer ", layer, " lists ", names_[ids[i]], " twice");
      regions.emplace_back(off, ids[i]);
    }
    std::sort(regions.begin(), regions.end());
    for (size_t i = 1; i < regions.size(); ++i) {
      const auto& prev = map[regions[i - 1].second];
      if (prev.offset + prev.nbytes > regions[i].first)
        fail("SlotMap", "slot map of layer ", layer, ": ", names_[regions[i - 1].second], " [", prev.offset, ", ",
             prev.offset + prev.nbytes, ") overlaps ", names_[regions[i].second], " at ", regions[i].first);
    }
    Layer& l = layers_[layer];
    l.map = std::move(map);
    l.has_map = true;
    check_coverage(layer, l);
  }

  // ---- the ring ----------------------------------------------------------------------------------------------
  // Copies `ids` (default: every member) of `layer` into the next slot of the ring; returns the slot.
  int64_t fetch(int64_t layer, std::optional<std::vector<int64_t>> ids) {
    Layer& l = layer_for_copy(layer);
    for (size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].state != SlotState::Free && slots_[s].layer == layer)
        fail("SlotBusy", "layer ", layer, " is already in slot ", s, "; fetch it once per pass");
    const int64_t s = next_;
    Slot& slot = slots_[s];
    if (slot.state != SlotState::Free)
      fail("SlotBusy", "the next slot of the ring (", s, " of ", slots_.size(), ") still holds layer ", slot.layer,
           slot.state == SlotState::InUse ? ", which compute has not released" : ", fetched but never acquired",
           "; overwriting it could change weights under a running kernel. Use more slots than the prefetch depth.");
    const std::vector<int64_t>& want = ids ? *ids : l.members;
    std::vector<CopyOp> ops = plan_copies(layer, l, slot, want);  // every byte-size check happens here first
    slot.layer = layer;
    slot.state = SlotState::Loading;
    slot.valid.clear();
    slot.valid.insert(want.begin(), want.end());
    next_ = (next_ + 1) % static_cast<int64_t>(slots_.size());
    if (cuda_) {
      const CudaDriver& d = cuda_driver();
      ensure_context();
      CUstream cs = copy_stream_;
      // The copy stream may not write the slot before the compute stream has finished reading it.
      if (slot.released_recorded) ck(d.stream_wait_event(cs, slot.released, 0), "cuStreamWaitEvent");
      auto [t0, t1] = timing_pair();
      ck(d.event_record(t0, cs), "cuEventRecord");
      issue_cuda(ops, cs);
      ck(d.event_record(t1, cs), "cuEventRecord");
      ck(d.event_record(slot.ready, cs), "cuEventRecord");
      copy_events_.emplace_back(t0, t1);
      return s;
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      slot.job = ++jobs_issued_;
      queue_.push_back(Job{slot.job, std::move(ops)});
    }
    cv_.notify_all();
    return s;
  }

  // The compute stream waits for `layer`'s slot to be ready (no host block on CUDA); returns the slot.
  int64_t acquire(int64_t layer, int64_t stream) {
    const int64_t s = slot_of(layer, "acquire");
    Slot& slot = slots_[s];
    if (slot.state == SlotState::InUse) fail("SlotBusy", "layer ", layer, " (slot ", s, ") is already acquired");
    if (cuda_) {
      const CudaDriver& d = cuda_driver();
      ensure_context();
      CUstream cur = reinterpret_cast<CUstream>(stream);
      auto [t0, t1] = timing_pair();
      ck(d.event_record(t0, cur), "cuEventRecord");
      ck(d.stream_wait_event(cur, slot.ready, 0), "cuStreamWaitEvent");
      ck(d.event_record(t1, cur), "cuEventRecord");
      stall_events_.emplace_back(t0, t1);
      compute_open_[s] = t1;
      slot.state = SlotState::InUse;
      return s;
    }
    const auto t0 = Clock::now();
    {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return jobs_done_ >= slot.job; });
    }
    stall_s_ += seconds_since(t0);
    slot.acquired_at = Clock::now();
    slot.state = SlotState::InUse;
    return s;
  }

  // Copies more tensors of an acquired layer into its slot (routed experts), ordered before the compute stream's
  // next kernel. Tensors already in the slot this occupancy are skipped. Returns the bytes copied.
  int64_t fetch_into(int64_t layer, const std::vector<int64_t>& ids, int64_t stream) {
    Layer& l = layer_for_copy(layer);
    const int64_t s = slot_of(layer, "fetch_into");
    Slot& slot = slots_[s];
    if (slot.state != SlotState::InUse)
      fail("MissingSlot", "layer ", layer, " must be acquired before copying more of its tensors into slot ", s);
    std::vector<int64_t> fresh;
    for (auto id : ids)
      if (!slot.valid.count(id)) fresh.push_back(id);
    if (fresh.empty()) return 0;
    std::vector<CopyOp> ops = plan_copies(layer, l, slot, fresh);
    int64_t total = 0;
    for (const auto& op : ops) total += op.nbytes;
    slot.valid.insert(fresh.begin(), fresh.end());
    if (cuda_) {
      const CudaDriver& d = cuda_driver();
      ensure_context();
      CUstream ds = demand_stream_;
      CUstream cur = reinterpret_cast<CUstream>(stream);
      // After the slot's own fetch (which itself waited for the previous occupant's release).
      ck(d.stream_wait_event(ds, slot.ready, 0), "cuStreamWaitEvent");
      auto [c0, c1] = timing_pair();
      ck(d.event_record(c0, ds), "cuEventRecord");
      issue_cuda(ops, ds);
      ck(d.event_record(c1, ds), "cuEventRecord");
      copy_events_.emplace_back(c0, c1);
      auto [w0, w1] = timing_pair();
      ck(d.event_record(w0, cur), "cuEventRecord");
      ck(d.stream_wait_event(cur, c1, 0), "cuStreamWaitEvent");
      ck(d.event_record(w1, cur), "cuEventRecord");
      stall_events_.emplace_back(w0, w1);
      return total;
    }
    const auto t0 = Clock::now();
    {
      py::gil_scoped_release nogil;
      for (const auto& op : ops) std::memcpy(op.dst, op.src, op.nbytes);
    }
    const double dt = seconds_since(t0);
    copy_s_ += dt;
    stall_s_ += dt;  // the CPU compute thread waited for these copies
    return total;
  }

  // Raises MissingSlot unless every id was copied into `layer`'s slot during this occupancy.
  void check_valid(int64_t layer, const std::vector<int64_t>& ids) const {
    const int64_t s = slot_of(layer, "read");
    const Slot& slot = slots_[s];
    for (auto id : ids)
      if (!slot.valid.count(id))
        fail("MissingSlot", "host tensor ", name_of(id), " of layer ", layer, " has not been copied into slot ", s,
             " in this occupancy; reading it would use another layer's stale bytes");
  }

  // The compute stream is done with `layer`: its slot may be refilled once the kernels queued so far finish.
  void release(int64_t layer, int64_t stream) {
    const int64_t s = slot_of(layer, "release");
    Slot& slot = slots_[s];
    if (slot.state != SlotState::InUse) fail("SlotBusy", "layer ", layer, " (slot ", s, ") was never acquired");
    if (cuda_) {
      const CudaDriver& d = cuda_driver();
      ensure_context();
      CUstream cur = reinterpret_cast<CUstream>(stream);
      ck(d.event_record(slot.released, cur), "cuEventRecord");
      slot.released_recorded = true;
      auto it = compute_open_.find(s);
      if (it != compute_open_.end()) {
        CUevent end = timing_pool_get();
        ck(d.event_record(end, cur), "cuEventRecord");
        compute_events_.emplace_back(it->second, end);
        compute_open_.erase(it);
      }
    }
    if (!cuda_) compute_s_ += seconds_since(slot.acquired_at);
    slot.state = SlotState::Free;
    slot.valid.clear();
  }

  // Waits for every queued copy; slots fetched but never acquired (an aborted pass) become free again.
  void drain() {
    if (cuda_) {
      ensure_context();
      ck(cuda_driver().stream_synchronize(copy_stream_), "cuStreamSynchronize");
      ck(cuda_driver().stream_synchronize(demand_stream_), "cuStreamSynchronize");
    }
    if (!cuda_) {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return jobs_done_ >= jobs_issued_; });
    }
    for (auto& s : slots_)
      if (s.state == SlotState::Loading) {
        s.state = SlotState::Free;
        s.valid.clear();
      }
  }

  // Which layer each slot holds (-1: none) and its state: "free" | "loading" | "in_use".
  std::vector<std::pair<int64_t, std::string>> slots_state() const {
    std::vector<std::pair<int64_t, std::string>> out;
    for (const auto& s : slots_)
      out.emplace_back(s.state == SlotState::Free ? -1 : s.layer,
                       s.state == SlotState::Free ? "free" : s.state == SlotState::Loading ? "loading" : "in_use");
    return out;
  }

  int64_t occupancy() const {
    int64_t n = 0;
    for (const auto& s : slots_) n += s.state != SlotState::Free;
    return n;
  }

  // Totals since the last reset: bytes and copies issued, seconds of copy, compute and stall. On CUDA this waits
  // for the timed work to finish and reads the events.
  py::dict stats() {
    double copy_s = copy_s_, compute_s = compute_s_, stall_s = stall_s_;
    if (cuda_) {
      ensure_context();
      copy_s = sum_elapsed(copy_events_);
      compute_s = sum_elapsed(compute_events_);
      stall_s = sum_elapsed(stall_events_);
    }
    if (!cuda_) {
      py::gil_scoped_release nogil;
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return jobs_done_ >= jobs_issued_; });
      copy_s += worker_copy_s_;
    }
    py::dict d;
    d["bytes"] = bytes_;
    d["copies"] = copies_;
    d["tensors"] = tensors_;
    d["copy_s"] = copy_s;
    d["compute_s"] = compute_s;
    d["stall_s"] = stall_s;
    return d;
  }

  void reset_stats() {
    bytes_ = copies_ = tensors_ = 0;
    copy_s_ = compute_s_ = stall_s_ = 0.0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      worker_copy_s_ = 0.0;
    }
    copy_events_.clear();
    stall_events_.clear();
    compute_events_.clear();
    compute_open_.clear();  // called between passes, when no layer is acquired
    timing_next_ = 0;
  }

 private:
  struct Job {
    uint64_t id;
    std::vector<CopyOp> ops;
  };

  int64_t check_slot(int64_t s) const {
    if (s < 0 || s >= static_cast<int64_t>(slots_.size()))
      fail("MissingSlot", "slot ", s, " does not exist (ring of ", slots_.size(), ")");
    return s;
  }

  void check_host(int64_t id) const {
    if (id < 0 || id >= static_cast<int64_t>(host_.size()))
      fail("MissingSlot", "host tensor id ", id, " was never registered (", host_.size(), " registered)");
  }

  std::string name_of(int64_t id) const {
    return id >= 0 && id < static_cast<int64_t>(names_.size()) ? names_[id] : "#" + std::to_string(id);
  }

  Layer& layer_for_copy(int64_t layer) {
    auto it = layers_.find(layer);
    if (it == layers_.end() || !it->second.has_map)
      fail("MissingSlot", "layer ", layer, " has no slot map: its host tensors have no device slot to go to");
    check_coverage(layer, it->second);
    return it->second;
  }

  void check_coverage(int64_t layer, const Layer& l) const {
    std::vector<std::string> missing;
    for (auto id : l.members)
      if (!l.map.count(id)) missing.push_back(name_of(id));
    if (missing.empty()) return;
    std::ostringstream os;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) os << (i ? ", " : "") << missing[i];
    if (missing.size() > 8) os << ", ... (" << missing.size() - 8 << " more)";
    fail("ShortSlotMap", "slot map of layer ", layer, " covers ", l.members.size() - missing.size(), " of its ",
         l.members.size(), " tensors; missing: ", os.str());
  }

  int64_t slot_of(int64_t layer, const char* what) const {
    for (size_t s = 0; s < slots_.size(); ++s)
      if (slots_[s].state != SlotState::Free && slots_[s].layer == layer) return static_cast<int64_t>(s);
    std::ostringstream held;
    for (size_t s = 0; s < slots_.size(); ++s)
      held << (s ? ", " : "") << (slots_[s].state == SlotState::Free ? std::string("free")
                                                                      : "layer " + std::to_string(slots_[s].layer));
    fail("MissingSlot", "cannot ", what, " layer ", layer, ": no device slot holds it (not fetched this pass); "
         "slots hold [", held.str(), "]");
  }

  // Byte-size checks for every tensor first, then the copy list (adjacent regions coalesced into one copy).
  std::vector<CopyOp> plan_copies(int64_t layer, const Layer& l, Slot& slot, const std::vector<int64_t>& ids) {
    struct One {
      int64_t offset;
      const uint8_t* src;
      int64_t nbytes;
    };
    std::vector<One> ones;
    ones.reserve(ids.size());
    std::unordered_set<int64_t> seen;
    for (auto id : ids) {
      check_host(id);
      auto it = l.map.find(id);
      if (it == l.map.end())
        fail("MissingSlot", "host tensor ", name_of(id), " has no device slot in layer ", layer, "'s slot map");
      const at::Tensor& src = host_[id];
      const int64_t src_bytes = static_cast<int64_t>(src.nbytes());
      if (src_bytes != it->second.nbytes)
        fail("ByteSizeMismatch", "copy of ", name_of(id), " (layer ", layer, "): source holds ", src_bytes,
             " bytes, its slot region [", it->second.offset, ", ", it->second.offset + it->second.nbytes, ") holds ",
             it->second.nbytes, " bytes; refusing to copy");
      if (!seen.insert(id).second) continue;
      ones.push_back(One{it->second.offset, static_cast<const uint8_t*>(src.data_ptr()), src_bytes});
    }
    std::sort(ones.begin(), ones.end(), [](const One& a, const One& b) { return a.offset < b.offset; });
    uint8_t* base = slot.buf.data_ptr<uint8_t>();
    std::vector<CopyOp> ops;
    for (const auto& o : ones) {
      if (o.nbytes == 0) continue;
      if (!ops.empty()) {
        CopyOp& last = ops.back();
        // Coalesce only exact continuations; the alignment gap between regions breaks a run (never copy padding).
        if (last.src + last.nbytes == o.src && last.dst + last.nbytes == base + o.offset) {
          last.nbytes += o.nbytes;
          continue;
        }
      }
      ops.push_back(CopyOp{o.src, base + o.offset, o.nbytes});
    }
    for (const auto& op : ops) bytes_ += op.nbytes;
    copies_ += static_cast<int64_t>(ops.size());
    tensors_ += static_cast<int64_t>(ones.size());
    return ops;
  }

  void work() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        job = std::move(queue_.front());
        queue_.pop_front();
      }
      const auto t0 = Clock::now();
      for (const auto& op : job.ops) std::memcpy(op.dst, op.src, op.nbytes);
      {
        std::lock_guard<std::mutex> lock(mu_);
        worker_copy_s_ += seconds_since(t0);
        jobs_done_ = job.id;
      }
      cv_.notify_all();
    }
  }

  // Asked of the driver, not of torch's allocator: memory registered with cudaHostRegister counts too.
  bool page_locked(const at::Tensor& t) {
    if (t.nbytes() == 0) return true;
    ensure_context();
    unsigned type = 0;
    CUresult r = cuda_driver().pointer_get_attribute(&type, kPointerAttributeMemoryType,
                                                     reinterpret_cast<uint64_t>(t.data_ptr()));
    return r == 0 && type == kMemoryTypeHost;
  }

  void ensure_context() {
    // torch makes the device's primary context current on the threads it uses; a thread that has not touched the
    // device yet (or holds another device's context) gets this device's primary context, as the runtime would.
    const CudaDriver& d = cuda_driver();
    CUcontext ctx = nullptr;
    ck(d.ctx_get_current(&ctx), "cuCtxGetCurrent");
    int current = -1;
    if (ctx) ck(d.ctx_get_device(&current), "cuCtxGetDevice");
    if (ctx && current == device_.index()) return;
    ck(d.init(0), "cuInit");
    int dev = 0;
    ck(d.device_get(&dev, device_.index()), "cuDeviceGet");
    CUcontext primary = nullptr;
    ck(d.primary_ctx_retain(&primary, dev), "cuDevicePrimaryCtxRetain");
    ck(d.ctx_set_current(primary), "cuCtxSetCurrent");
  }

  void issue_cuda(const std::vector<CopyOp>& ops, CUstream stream) {
    for (const auto& op : ops)
      ck(cuda_driver().memcpy_htod_async(reinterpret_cast<uint64_t>(op.dst), op.src, op.nbytes, stream),
         "cuMemcpyHtoDAsync");
  }

  CUevent timing_pool_get() {
    if (timing_next_ == timing_pool_.size()) {
      CUevent e = nullptr;
      ck(cuda_driver().event_create(&e, 0), "cuEventCreate");
      timing_pool_.push_back(e);
    }
    return timing_pool_[timing_next_++];
  }

  std::pair<CUevent, CUevent> timing_pair() {
    CUevent a = timing_pool_get();
    return {a, timing_pool_get()};
  }

  double sum_elapsed(const std::vector<std::pair<CUevent, CUevent>>& pairs) {
    double total = 0.0;
    for (const auto& [a, b] : pairs) {
      ck(cuda_driver().event_synchronize(b), "cuEventSynchronize");
      float ms = 0.f;
      ck(cuda_driver().event_elapsed(&ms, a, b), "cuEventElapsedTime");
      total += ms * 1e-3;
    }
    return total;
  }

  CUstream copy_stream_ = nullptr, demand_stream_ = nullptr;
  std::vector<CUevent> timing_pool_;
  size_t timing_next_ = 0;
  std::vector<std::pair<CUevent, CUevent>> copy_events_, stall_events_, compute_events_;
  std::unordered_map<int64_t, CUevent> compute_open_;

  at::Device device_{at::kCPU};
  bool cuda_ = false;
  int64_t slot_bytes_ = 0;
  std::vector<Slot> slots_;
  int64_t next_ = 0;
  std::vector<at::Tensor> host_;
  std::vector<std::string> names_;
  std::unordered_map<int64_t, Layer> layers_;

  int64_t bytes_ = 0, copies_ = 0, tensors_ = 0;
  double copy_s_ = 0.0, compute_s_ = 0.0, stall_s_ = 0.0;

  // CPU build: the worker thread is the copy stream; job ids are the events.
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  uint64_t jobs_issued_ = 0, jobs_done_ = 0;
  double worker_copy_s_ = 0.0;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace kimiserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using kimiserve::StreamEngine;
  m.doc() = "kimiserve weight-streaming engine (ring of device slots fed from host memory)";
  m.attr("ALIGN") = kimiserve::kAlign;
  m.def("register_errors", [](py::dict classes) {
    for (auto item : classes) (*kimiserve::g_errors)[item.first.cast<std::string>()] =
        py::reinterpret_borrow<py::object>(item.second);
  });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kimiserve::StreamError& e) {
      auto it = kimiserve::g_errors->find(e.kind);
      if (it != kimiserve::g_errors->end()) {
        PyErr_SetString(it->second.ptr(), e.what());
      } else {
        PyErr_SetString(PyExc_RuntimeError, (e.kind + ": " + e.what()).c_str());
      }
    }
  });
  py::class_<StreamEngine>(m, "StreamEngine")
      .def(py::init<int64_t, int64_t, const std::string&, int64_t, int64_t>(), py::arg("num_slots"),
           py::arg("slot_bytes"), py::arg("device"), py::arg("copy_stream") = 0, py::arg("demand_stream") = 0)
      .def_property_readonly("num_slots", &StreamEngine::num_slots)
      .def_property_readonly("slot_bytes", &StreamEngine::slot_bytes)
      .def_property_readonly("is_cuda", &StreamEngine::is_cuda)
      .def("slot", &StreamEngine::slot, py::arg("index"))
      .def("add_host", &StreamEngine::add_host, py::arg("tensor"), py::arg("name"))
      .def("set_members", &StreamEngine::set_members, py::arg("layer"), py::arg("ids"))
      .def("set_slot_map", &StreamEngine::set_slot_map, py::arg("layer"), py::arg("ids"), py::arg("offsets"),
           py::arg("nbytes"))
      .def("fetch", &StreamEngine::fetch, py::arg("layer"), py::arg("ids") = py::none())
      .def("acquire", &StreamEngine::acquire, py::arg("layer"), py::arg("stream") = 0)
      .def("fetch_into", &StreamEngine::fetch_into, py::arg("layer"), py::arg("ids"), py::arg("stream") = 0)
      .def("check_valid", &StreamEngine::check_valid, py::arg("layer"), py::arg("ids"))
      .def("release", &StreamEngine::release, py::arg("layer"), py::arg("stream") = 0)
      .def("drain", &StreamEngine::drain)
      .def("slots_state", &StreamEngine::slots_state)
      .def("occupancy", &StreamEngine::occupancy)
      .def("stats", &StreamEngine::stats)
      .def("reset_stats", &StreamEngine::reset_stats);
}
