// The folder a training run saves into (`colossal train --save_dir`): checked before step 1
// (created and probed with a real write), owned by one job at a time (an flock on
// "<dir>/.lock"), its complete checkpoints listed, stale temporaries of crashed saves removed,
// and old checkpoints pruned (--keep_last). Layout: "<dir>/step-NNNNNNNN/" (a complete
// checkpoint once it has that name: StagedDirectory renames it into place whole), "<dir>/latest"
// (a text file naming one), and the temporaries of a save that died: "step-N.staging",
// "step-N.old", "latest.tmp-<pid>".
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace colossal::app {

// "step-00000042": the folder name of the checkpoint after `step` optimizer steps.
std::string step_dir_name(int64_t step);

// Creates `dir` (and its parents), then writes, fsyncs and removes a probe file in it named
// after this host and process (ranks of one job probe a shared folder side by side). InputError
// naming `option`, the folder and the OS's reason (read-only, a path under a file, a name too
// long, no space, ...) otherwise.
void probe_writable_dir(const std::string& dir, const std::string& option);

// An exclusive flock on "<dir>/.lock" for the lifetime of the object; the file holds the
// owner's "host pid" so a second job can name it. The lock goes with the process (also on a
// crash or SIGKILL); the file stays, which is harmless: only the flock counts.
class RunDirLock {
 public:
  // InputError naming the folder (and the owner's host and pid when the file tells them) when
  // another job holds it.
  explicit RunDirLock(const std::string& dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

struct StepDir {
  int64_t step = 0;
  std::string name;  // "step-00000042"
};

// The complete checkpoints in `dir` (step-N folders holding trainer_state.json), oldest first.
std::vector<StepDir> complete_steps(const std::string& dir);

// Whether `dir` holds (part of) a run: a `latest` file or any step-N folder.
bool holds_run(const std::string& dir);

// Removes what a save killed midway leaves: "latest.tmp-*", "step-N.staging" and "step-N.old"
// (the latter only when step-N itself is there; alone it is the only copy of that step). Call
// under the lock, before any rank writes. Returns the names removed.
std::vector<std::string> remove_stale_temporaries(const std::string& dir);

// The checkpoint to resume from `path`: `path` itself when it is a step folder; in a save_dir,
// the newest complete step, which is what `latest` names unless a save was killed between
// committing a step and updating `latest` (or `latest` is missing). `why` says which was picked
// and why when that is not simply `latest`.
std::string resolve_checkpoint(const std::string& path, std::string* why = nullptr);

// --keep_last: removes the complete step folders of `dir` older than its newest `keep`, never
// the one `latest` names. keep 0 keeps everything. Returns the names removed; a folder that
// cannot be removed is a warning (the run goes on; the space is the user's to reclaim).
std::vector<std::string> prune_steps(const std::string& dir, int64_t keep);

}  // namespace colossal::app
