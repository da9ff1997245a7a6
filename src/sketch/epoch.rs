//! Param epochs: how the weight sketch's memo knows, without reading a weight, that it has not
//! changed.
//!
//! A weight sketch ([`super::SketchSpec::memo`]) is param-invariant: its value changes only when
//! a param is written. RLX 0.2.19 does not tell a kernel about param writes, so the kernel keys
//! its memo by a 128-bit hash of the weight's bytes, which reads the whole weight on every run
//! (measured: 5-10% of a tapped chain MLP's GEMM time at L = 64, the weights cold in cache).
//!
//! opscope's executable wrapper (`activate::env`, wrapping every executable whose graph holds a
//! weight sketch, in the environment mode and under a scope alike) does see every param write:
//! RLX's CPU executable keeps params "solely in the arena, in dedicated, never-aliased slots"
//! (`rlx_runtime` 0.2.19, `CpuExecutable::set_param`), written only through the executable's
//! methods. The wrapper holds an *epoch*, a process-unique number ([`next`]) that it replaces on
//! every call that may write params or state (`set_param*`, `finalize_params`, the handle, KV and
//! MoE methods, `copy_params_from`), and sets to 0 for good once the executable hands out a way
//! around it (`arena_ptr`, `executable_as_any(_mut)`, `share_params_from`, `optimizer_step_resident`).
//! Around each run it marks the running thread with that epoch ([`RunEpoch`]).
//!
//! The kernel then reuses a weight sketch without hashing when it runs on a thread outside RLX's
//! rayon pool whose epoch is not 0, and the same sketch node (its attributes are unique per node
//! and compile) already computed it in that epoch: no param of that executable was written
//! since. A thread outside the pool runs only the schedule of the run it called, so the epoch is
//! that executable's. Everything else takes the hashed path, exact as before: epoch 0 (an
//! executable not wrapped, or one that escaped), and any kernel on a pool worker, which may be
//! running another executable's schedule it picked up while waiting inside a parallel kernel,
//! under the epoch of the run it came from (a review reproduced stale sketches that way before
//! this rule: 3 000-7 000 of 20 000 steps). RLX runs a schedule on the caller's thread when its
//! pool has one worker (`RLX_WORKERS=1`; the default on 2 cores, 3/4 of the CPUs) or with
//! `RLX_CPU_EXEC_IN_POOL=0`; with more workers it moves the schedule into the pool and every
//! run hashes. Tests: `tests/weight_epoch.rs`.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};

static NEXT: AtomicU64 = AtomicU64::new(1);

thread_local! {
    static CURRENT: Cell<u64> = const { Cell::new(0) };
}

/// A fresh epoch: never 0, never returned twice in this process.
pub fn next() -> u64 {
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// The epoch of the run on this thread (0: none known).
pub fn current() -> u64 {
    CURRENT.with(Cell::get)
}

/// Marks this thread's runs with an executable's epoch until dropped (then restores the
/// previous mark, so nested runs unwind correctly). Epoch 0 marks a run as unknown.
#[must_use = "the mark lasts while the guard lives"]
pub struct RunEpoch {
    prev: u64,
}

impl RunEpoch {
    /// Mark this thread with `epoch` for the guard's lifetime.
    pub fn enter(epoch: u64) -> RunEpoch {
        RunEpoch { prev: CURRENT.with(|c| c.replace(epoch)) }
    }
}

impl Drop for RunEpoch {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.prev));
    }
}
