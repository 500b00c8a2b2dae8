// The calling thread's OpenMP worker pool: kakeya::release_thread_pool.
//
// libgomp keeps one worker pool per thread that ever opened a parallel region, and when more of its threads exist
// than the process may run on (its CPU affinity), every worker waits for the next region by sleeping (a futex
// wake, tens of microseconds) instead of spinning. A server loads the model on its main thread (one pool) and then
// runs every step on an engine thread (a second pool): on two cores that throttled wait came before each of the
// ~200 parallel regions of a SmolLM2 decode step, +60% on the step. Releasing the loading thread's pool once it is
// done brings the count back under the limit. Numerics are untouched: which thread runs a work item never changes
// its result (every kernel here is invariant to the thread count).

#include <omp.h>
#include <torch/library.h>

namespace {

// Frees the calling thread's pool (OpenMP 5.0 omp_pause_resource_all, soft: the next parallel region this thread
// opens builds a new one). False when the runtime refused (inside a parallel region, or unsupported).
bool release_thread_pool() { return omp_pause_resource_all(omp_pause_soft) == 0; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(kakeya, m) { m.def("release_thread_pool() -> bool", &release_thread_pool); }
