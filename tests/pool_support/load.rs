//! A put-and-read load on a pool, shared by the tests that kill a process while it runs
//! (master_kill_under_load, master_failover_under_load): puts retried until they commit, readers
//! that read committed objects back and record any that return other bytes, and the final check
//! that every committed object reads back exactly. I/O boundary: the pool client's calls to the
//! master and the agents.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvpool_client::pool::PoolClient;
use kvpool_core::master::PutOptions;
use kvpool_harness::ChildProcess;
use parking_lot::Mutex;
use tokio::task::JoinHandle;

use super::DEADLINE;

/// The objects of a load: object `id` is stored under `<prefix>/<id>`; its value has a length
/// spread over steps from the id and content derived from the id and a per-test seed.
#[derive(Clone, Copy)]
pub struct Objects {
    prefix: &'static str,
    seed: u64,
    min_len: usize,
    steps: u64,
    step: usize,
    odd: u64,
}

/// Object id -> crc32c of its value, for every put that committed.
pub type Committed = Arc<Mutex<HashMap<u64, u32>>>;

impl Objects {
    /// Objects under `prefix` whose content is seeded with `seed`; 4 KiB long until
    /// [`Objects::lengths`] says otherwise.
    pub const fn new(prefix: &'static str, seed: u64) -> Self {
        Self {
            prefix,
            seed,
            min_len: 4096,
            steps: 1,
            step: 0,
            odd: 1,
        }
    }

    /// Value lengths of `min_len`, plus one of `steps` steps of `step` bytes, plus up to `odd - 1`
    /// bytes (so that lengths are rarely aligned), each picked from the id.
    pub const fn lengths(self, min_len: usize, steps: u64, step: usize, odd: u64) -> Self {
        Self {
            min_len,
            steps,
            step,
            odd,
            ..self
        }
    }

    /// The key of object `id`.
    pub fn key(self, id: u64) -> Vec<u8> {
        format!("{}/{id}", self.prefix).into_bytes()
    }

    /// The value of object `id`.
    pub fn value(self, id: u64) -> Vec<u8> {
        let len =
            self.min_len + (id * 7919 % self.steps) as usize * self.step + (id % self.odd) as usize;
        kvpool_harness::bytes::pseudo_random(id ^ self.seed, len)
    }

    /// Puts object `id` until a put commits, pausing `pause` after each failure (like a real
    /// client, which retries while the pool recovers); calls `on_fail` with each failed
    /// attempt's error and returns the crc32c of the committed value. Panics once [`DEADLINE`]
    /// has passed since `started`.
    pub async fn put_until_committed(
        self,
        pool: &PoolClient,
        opts: &PutOptions,
        id: u64,
        started: Instant,
        pause: Duration,
        mut on_fail: impl FnMut(String),
    ) -> u32 {
        let v = self.value(id);
        loop {
            match pool.put(&self.key(id), &v, opts).await {
                Ok(_) => return crc32c::crc32c(&v),
                Err(e) => {
                    on_fail(format!("{e:#}"));
                    assert!(
                        started.elapsed() < DEADLINE,
                        "put {id} never succeeded: {e:#}"
                    );
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }

    /// Starts `n` readers that read committed objects back until [`Readers::stop`]. A read may
    /// fail while the pool recovers; one that returns bytes with another length or checksum is
    /// recorded as bad.
    pub fn spawn_readers(self, n: usize, pool: &PoolClient, committed: &Committed) -> Readers {
        let done = Arc::new(AtomicBool::new(false));
        let reads = Arc::new(AtomicU64::new(0));
        let bad = Arc::new(Mutex::new(Vec::new()));
        let tasks = (0..n)
            .map(|r| {
                let (pool, committed, done, reads, bad) = (
                    pool.clone(),
                    committed.clone(),
                    done.clone(),
                    reads.clone(),
                    bad.clone(),
                );
                tokio::spawn(async move {
                    let mut n = r as u64;
                    while !done.load(Ordering::Relaxed) {
                        let pick = {
                            let c = committed.lock();
                            let ids: Vec<(u64, u32)> = c.iter().map(|(k, v)| (*k, *v)).collect();
                            ids.get((n as usize * 7) % ids.len().max(1)).copied()
                        };
                        n += 1;
                        let Some((id, crc)) = pick else {
                            tokio::time::sleep(Duration::from_millis(5)).await;
                            continue;
                        };
                        if let Ok(got) = pool.get(&self.key(id)).await {
                            reads.fetch_add(1, Ordering::Relaxed);
                            if crc32c::crc32c(&got) != crc || got.len() != self.value(id).len() {
                                bad.lock().push(format!(
                                    "object {id}: {} bytes, wrong checksum",
                                    got.len()
                                ));
                            }
                        }
                    }
                })
            })
            .collect();
        Readers {
            done,
            reads,
            bad,
            tasks,
        }
    }

    /// Asserts that every committed object reads back with its checksum and exact bytes;
    /// `what` names them in the failure ("committed object", "acknowledged put").
    pub async fn assert_read_back(
        self,
        pool: &PoolClient,
        committed: &HashMap<u64, u32>,
        what: &str,
    ) {
        for (&id, &crc) in committed {
            let got = pool
                .get(&self.key(id))
                .await
                .unwrap_or_else(|e| panic!("{what} {id} lost: {e:#}"));
            assert_eq!(crc32c::crc32c(&got), crc, "object {id} checksum");
            assert!(got == self.value(id), "object {id} bytes");
        }
    }
}

/// Waits until `commits` reaches `n` (the load has made that much progress), while every one
/// of `procs` runs; panics after [`DEADLINE`].
pub async fn wait_commits(commits: &AtomicU64, n: u64, procs: &mut [&mut ChildProcess]) {
    let started = Instant::now();
    while commits.load(Ordering::Relaxed) < n {
        for p in procs.iter_mut() {
            p.assert_running().expect("running");
        }
        assert!(started.elapsed() < DEADLINE, "no progress before the kill");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// Waits for each of `tasks` (writers, loops) to finish, panicking if one panicked or if one
/// takes longer than [`DEADLINE`].
pub async fn join_tasks(tasks: impl IntoIterator<Item = JoinHandle<()>>) {
    for t in tasks {
        tokio::time::timeout(DEADLINE, t)
            .await
            .expect("tasks finish")
            .expect("task");
    }
}

/// Readers started by [`Objects::spawn_readers`].
pub struct Readers {
    done: Arc<AtomicBool>,
    reads: Arc<AtomicU64>,
    bad: Arc<Mutex<Vec<String>>>,
    tasks: Vec<JoinHandle<()>>,
}

impl Readers {
    /// Stops the readers once their current read ends; returns how many reads returned bytes.
    /// Panics if any returned other bytes than were written.
    pub async fn stop(self) -> u64 {
        self.done.store(true, Ordering::Relaxed);
        for t in self.tasks {
            t.await.expect("reader task");
        }
        let bad = self.bad.lock();
        assert!(bad.is_empty(), "{bad:?}");
        self.reads.load(Ordering::Relaxed)
    }
}
