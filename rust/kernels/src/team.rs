//! A team of threads that stays inside one parallel region for a whole decode step.
//!
//! At batch 1 a decode step is some 150 small parallel calls (four projections and the
//! attention per layer). Through an OpenMP runtime each call forks and joins its team,
//! about 2 µs on two cores, and each join leaves a thread idle until the last part ends.
//! [`run_in_team`] enters the region once: the first thread (the leader) runs the step's
//! code, and every `Parallel::run` it makes hands the parts to the other threads, which
//! spin on one atomic word between calls instead of leaving the region.
//!
//! Which thread runs which part does not change any value: parts are the same ranges the
//! kernels would hand any other `Parallel`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use crate::attention::{KernelError, Parallel};

/// Idle polls before a waiting thread starts yielding its core (a few tens of µs of
/// spinning: longer than any gap between two calls of a step on a quiet machine).
const SPINS_BEFORE_YIELD: u32 = 1 << 14;

/// The job board the leader and the helpers share.
///
/// `state` packs the job number (high 32 bits), its part count (next 16) and the next
/// unclaimed part (low 16). A thread claims part `i` by moving the low field from `i` to
/// `i + 1` with one compare-and-swap, so a claim can never land on a later job.
struct Board {
    state: AtomicU64,
    /// The address of the current job's [`Task`] (a reference on the leader's stack).
    task: AtomicUsize,
    finished: AtomicUsize,
    quit: AtomicBool,
    panicked: AtomicBool,
}

const PART_BITS: u32 = 16;
const MAX_PARTS: usize = (1 << PART_BITS) - 1;

fn unpack(state: u64) -> (u64, usize, usize) {
    let mask = (1u64 << PART_BITS) - 1;
    (
        state >> (2 * PART_BITS),
        ((state >> PART_BITS) & mask) as usize,
        (state & mask) as usize,
    )
}

fn pack(job: u64, parts: usize, next: usize) -> u64 {
    (job << (2 * PART_BITS)) | ((parts as u64) << PART_BITS) | next as u64
}

type Task<'a> = &'a (dyn Fn(usize) + Sync);

impl Board {
    fn new() -> Self {
        Self {
            state: AtomicU64::new(0),
            task: AtomicUsize::new(0),
            finished: AtomicUsize::new(0),
            quit: AtomicBool::new(false),
            panicked: AtomicBool::new(false),
        }
    }

    /// Claims the current job's next part and runs it. False when there was none.
    fn try_run_one(&self) -> bool {
        let state = self.state.load(Ordering::Acquire);
        let (job, parts, next) = unpack(state);
        if next >= parts {
            return false;
        }
        let claimed = self.state.compare_exchange_weak(
            state,
            pack(job, parts, next + 1),
            Ordering::Acquire,
            Ordering::Relaxed,
        );
        if claimed.is_err() {
            return true; // someone else moved the board: look again at once
        }
        // The claimed part is unfinished, so the leader is still inside `run` for this
        // job and the address is this job's.
        let at = self.task.load(Ordering::Relaxed) as *const Task<'_>;
        // SAFETY: `run` stored the address of its `Task` and keeps it (and what it refers
        // to) alive until every part has finished, and this part has not.
        let task: Task<'_> = unsafe { *at };
        if catch_unwind(AssertUnwindSafe(|| task(next))).is_err() {
            self.panicked.store(true, Ordering::Relaxed);
        }
        self.finished.fetch_add(1, Ordering::Release);
        true
    }

    /// A helper's life: run whatever parts appear until the leader is done.
    fn help(&self) {
        let mut idle = 0u32;
        while !self.quit.load(Ordering::Acquire) {
            if self.try_run_one() {
                idle = 0;
            } else {
                wait_a_little(&mut idle);
            }
        }
    }
}

fn wait_a_little(idle: &mut u32) {
    if *idle < SPINS_BEFORE_YIELD {
        *idle += 1;
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// The `Parallel` the leader's code runs on: parts go on the board, the leader takes its
/// share, and `run` returns when every part has finished.
struct Team<'b> {
    board: &'b Board,
}

impl Parallel for Team<'_> {
    fn waiting(&self) -> bool {
        true
    }

    fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
        if parts <= 1 || parts > MAX_PARTS {
            // Nothing to share (or more parts than the board counts): run them here.
            (0..parts).for_each(task);
            return;
        }
        let board = self.board;
        // Only the address goes on the board: it is read back (see `try_run_one`) only
        // while a part of this job is unfinished, and this call waits for all of them.
        let task: Task<'_> = task;
        board
            .task
            .store(&task as *const Task<'_> as usize, Ordering::Relaxed);
        board.finished.store(0, Ordering::Relaxed);
        let (job, _, _) = unpack(board.state.load(Ordering::Relaxed));
        // Release: a helper that sees the new job also sees its task and the reset count.
        board.state.store(
            pack(job.wrapping_add(1) & 0xffff_ffff, parts, 0),
            Ordering::Release,
        );
        while board.try_run_one() {}
        let mut idle = 0;
        while board.finished.load(Ordering::Acquire) < parts {
            wait_a_little(&mut idle);
        }
        // Every part has finished, so nothing refers to `task` any more: the leader may
        // now stop the step rather than go on with a part's output missing.
        if board.panicked.load(Ordering::Relaxed) {
            panic!("a kernel part panicked on a team thread");
        }
    }
}

/// Sets `quit` when the leader leaves, by return or by panic, so the helpers never wait
/// for a job that will not come.
struct Dismiss<'b>(&'b Board);

impl Drop for Dismiss<'_> {
    fn drop(&mut self) {
        self.0.quit.store(true, Ordering::Release);
    }
}

/// Runs `body` once, on the first of `threads` threads that `parallel` starts together;
/// the others serve the `Parallel` that `body` is given until it returns. With one thread
/// (or a runtime that gives fewer than asked) `body` runs its parts itself.
pub fn run_in_team<R: Send>(
    threads: usize,
    parallel: &dyn Parallel,
    body: impl FnOnce(&dyn Parallel) -> Result<R, KernelError> + Send,
) -> Result<R, KernelError> {
    if threads <= 1 {
        return body(&Team {
            board: &Board::new(),
        });
    }
    let board = Board::new();
    let body = Mutex::new(Some(body));
    let result = Mutex::new(None);
    parallel.run(threads, &|member| {
        if member == 0 {
            let _dismiss = Dismiss(&board);
            let body = body.lock().unwrap_or_else(|e| e.into_inner()).take();
            if let Some(body) = body {
                let outcome = body(&Team { board: &board });
                *result.lock().unwrap_or_else(|e| e.into_inner()) = Some(outcome);
            }
        } else {
            board.help();
        }
    });
    if board.panicked.load(Ordering::Relaxed) {
        return Err(KernelError(
            "a kernel part panicked on a team thread".into(),
        ));
    }
    result
        .into_inner()
        .unwrap_or_else(|e| e.into_inner())
        .unwrap_or_else(|| Err(KernelError("the team's leader did not run".into())))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::ScopedThreads;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn every_part_of_every_call_runs_once() {
        let counts: Vec<AtomicUsize> = (0..64).map(|_| AtomicUsize::new(0)).collect();
        let out = run_in_team(3, &ScopedThreads, |team| {
            for call in 0..500 {
                let parts = 1 + call % 7;
                team.run(parts, &|p| {
                    counts[(call * 7 + p) % 64].fetch_add(1, Ordering::Relaxed);
                });
            }
            Ok(42)
        })
        .unwrap();
        assert_eq!(out, 42);
        let total: usize = counts.iter().map(|c| c.load(Ordering::Relaxed)).sum();
        assert_eq!(total, (0..500).map(|c| 1 + c % 7).sum::<usize>());
    }

    /// A runtime that runs the parts one after another on one thread: the leader must not
    /// wait for helpers that start only after it returns.
    struct OneThread;
    impl Parallel for OneThread {
        fn run(&self, parts: usize, task: &(dyn Fn(usize) + Sync)) {
            (0..parts).for_each(task);
        }
    }

    #[test]
    fn a_team_of_one_thread_finishes() {
        let sum = AtomicUsize::new(0);
        run_in_team(4, &OneThread, |team| {
            team.run(4, &|p| {
                sum.fetch_add(p, Ordering::Relaxed);
            });
            Ok(())
        })
        .unwrap();
        assert_eq!(sum.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn errors_and_panics_come_back() {
        let err = run_in_team(2, &ScopedThreads, |_| {
            Err::<(), _>(KernelError("no".into()))
        });
        assert_eq!(err.unwrap_err().0, "no");
        // Part 1 fails on whichever thread claims it: the call must not report success,
        // and must not hang.
        let failed = std::panic::catch_unwind(|| {
            run_in_team(2, &ScopedThreads, |team| {
                team.run(2, &|p| assert_ne!(p, 1, "part 1 fails"));
                Ok(())
            })
        });
        assert!(!matches!(failed, Ok(Ok(()))));
    }
}
