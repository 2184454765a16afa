//! The phases of a `kvpool bench store` run, in the order every worker runs them between the
//! coordinator's barriers. Pure.

/// One barrier-separated step every worker runs at the same time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Put(u64),
    Get(u64),
    Exists,
    Prefix,
    /// Drop the objects of a size (not timed) so the next size has room.
    Remove(u64),
}

impl Phase {
    pub fn name(self) -> String {
        match self {
            Phase::Put(s) => format!("put:{s}"),
            Phase::Get(s) => format!("get:{s}"),
            Phase::Exists => "exists".into(),
            Phase::Prefix => "prefix".into(),
            Phase::Remove(s) => format!("remove:{s}"),
        }
    }
}

/// The phases of a run: per size, `rounds` times put then get then remove (the pool's memory
/// bounds how much one round can hold); after the first size's first get, the metadata phases
/// over its (still committed) keys.
pub fn plan(sizes: &[u64], rounds: u32) -> Vec<Phase> {
    let mut out = Vec::new();
    for (i, &s) in sizes.iter().enumerate() {
        for r in 0..rounds {
            out.push(Phase::Put(s));
            out.push(Phase::Get(s));
            if i == 0 && r == 0 {
                out.push(Phase::Exists);
                out.push(Phase::Prefix);
            }
            out.push(Phase::Remove(s));
        }
    }
    out
}
