// The threads the kernels share a call's work among: the calling thread, and helpers that join as the OS runs them.
//
// A call never waits for a thread that has not started on its work. On a machine another process shares, a helper
// may be off its core for a scheduler's time slice (milliseconds) at any moment; a team that met at a barrier after
// each of a step's few hundred calls (OpenMP's, torch's) waited out such a slice at nearly every call. Here the
// caller does whatever work no helper has taken, and waits only for a helper that is inside the call. The work must
// be taken dynamically (for_each_share_with), so that whoever runs does it all.
#pragma once

#include <cstdint>

namespace specserve {

// Threads a call may use, the caller included (1: the caller alone).
int64_t team_threads();

// Sets the threads calls may use (at least 1); helpers are started on the next call that can use them.
void set_team_threads(int64_t threads);

// Times a helper has stood aside for a while, having had its core for too little of the time it wanted it: another
// process as busy as itself shares that core, and the caller does better alone meanwhile.
int64_t team_rests();

// Whether this thread is running a call's work already (work it calls runs on this thread alone).
bool in_team_work();

// Runs work(context, 0) on this thread and work(context, s) for s = 1 .. slots - 1 on each helper that joins before
// the work is done; returns when work(context, 0) has returned and so has every helper that joined. work(context, 0)
// must finish whatever no helper took.
void run_team_call(int64_t slots, void (*work)(const void* context, int64_t slot), const void* context);

// Runs body(slot) as run_team_call runs work.
template <typename Body>
void run_with_team(int64_t slots, const Body& body) {
  run_team_call(slots, [](const void* context, int64_t slot) { (*static_cast<const Body*>(context))(slot); }, &body);
}

}  // namespace specserve
