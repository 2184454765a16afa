//! The slow-client campaign at scale of issue 38, against real processes on loopback: "Slow-body,
//! slow-header and silent connections (1,100, from 4 source addresses) against the conductor,
//! engine, agent admin and master ports: ≤ 5% still held after 20 s, and a real client on
//! another address succeeds throughout; documented figures for a client sharing the attacker's
//! address."
//!
//! One `kvpool master`, one `kvpool agent run` in pool mode, one synthetic `kvpool engine`
//! (prefill and decode) and one `kvpool conductor` over it run as children. 1,100 attacker
//! connections from 127.0.0.2 to 127.0.0.5 go to the conductor's API port, the engine's API
//! port, the agent's admin port and the master's port, a mix of three kinds, each trickled a
//! byte a second for as long as the server keeps it: a request head that never ends (on the
//! master, an HTTP/2 client preface), a whole head announcing a 1,000,000-byte body that never
//! ends (on the master, the preface and a DATA frame that never ends), and silence. Meanwhile a
//! real client on 127.0.0.1 makes a real request to each port every 200 ms on a fresh
//! connection (a completion through the conductor, a completion from the engine, the agent's
//! `/readyz`, the master's `Stats` over gRPC) and must always succeed, and a client on
//! 127.0.0.2, the attackers' own address, does the same for the figures. 20 s after the attack
//! started, an attacker connection is still held if a non-blocking read finds it neither at
//! end of file nor reset; at most 5% may be. Each port's figures are printed.
//!
//! Every server runs with its default limits: each already cuts all three kinds within 20 s
//! (HTTP servers: a head within 10 s of the connection, a body within 15 s of its head, looked
//! at once a second; the master: an authenticated call within its 10 s handshake deadline), so
//! no flag is shortened. The agent's admin port has no POST route: it answers a slow body's
//! head at once (405) and closes without waiting for the body. About 69 attackers per source
//! and port stay under every per-source cap (HTTP 1,024, master 512), so nothing is evicted or
//! refused: each connection is cut by a deadline. The test raises its soft descriptor limit to
//! the hard one where it is too low for the attack (the children inherit it).

use std::io::Read as _;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use kvpool_harness::{ChildProcess, Launcher, Probe, free_addr, kvpool_command};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;

mod pool_support;

use pool_support::{DEADLINE, KEY, KVPOOL};

/// Attacker connections in all.
const ATTACKERS: usize = 1_100;
/// At most this many may still be held at the mark (5%).
const HELD_MAX: usize = ATTACKERS / 20;
/// The attackers' source addresses.
const SOURCES: [Ipv4Addr; 4] = [
    Ipv4Addr::new(127, 0, 0, 2),
    Ipv4Addr::new(127, 0, 0, 3),
    Ipv4Addr::new(127, 0, 0, 4),
    Ipv4Addr::new(127, 0, 0, 5),
];
/// The real client's address, which no attacker uses.
const REAL: Ipv4Addr = Ipv4Addr::LOCALHOST;
/// The client that shares an attacker's address.
const SHARED: Ipv4Addr = SOURCES[0];
/// When the held connections are counted, after the attack starts.
const MARK: Duration = Duration::from_secs(20);
/// An attacker sends one more byte this often.
const TRICKLE: Duration = Duration::from_secs(1);
/// A client makes one request this often.
const EVERY: Duration = Duration::from_millis(200);
/// One client request must be answered within this.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Descriptors the test process needs: the attack, the clients and the rest.
const FDS_NEEDED: u64 = ATTACKERS as u64 + 512;

const MODEL: &str = "kvpool-synthetic";
const BLOCK: &str = "16";
/// The HTTP/2 client connection preface.
const H2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// An empty HTTP/2 SETTINGS frame.
const H2_SETTINGS: [u8; 9] = [0, 0, 0, 0x4, 0, 0, 0, 0, 0];
/// The header of a 16,384-byte HTTP/2 DATA frame on stream 1.
const H2_DATA: [u8; 9] = [0, 0x40, 0, 0x0, 0, 0, 0, 0, 1];

/// The ports under attack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Port {
    Conductor,
    Engine,
    AgentAdmin,
    Master,
}

impl Port {
    const ALL: [Port; 4] = [
        Port::Conductor,
        Port::Engine,
        Port::AgentAdmin,
        Port::Master,
    ];

    fn name(self) -> &'static str {
        match self {
            Port::Conductor => "conductor",
            Port::Engine => "engine",
            Port::AgentAdmin => "agent-admin",
            Port::Master => "master",
        }
    }

    /// The path the attackers' requests name (HTTP ports).
    fn path(self) -> &'static str {
        match self {
            Port::AgentAdmin => "/readyz",
            _ => "/v1/completions",
        }
    }
}

/// The kinds of attacker connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    SlowHeader,
    SlowBody,
    Silent,
}

impl Kind {
    const ALL: [Kind; 3] = [Kind::SlowHeader, Kind::SlowBody, Kind::Silent];

    fn name(self) -> &'static str {
        match self {
            Kind::SlowHeader => "slow_header",
            Kind::SlowBody => "slow_body",
            Kind::Silent => "silent",
        }
    }
}

/// What an attacker sends at once on connecting, and what it then trickles a byte per
/// [`TRICKLE`] (each script is longer than the attack lasts).
fn script(port: Port, kind: Kind) -> (Vec<u8>, Vec<u8>) {
    let filler = "a".repeat(256);
    match (port, kind) {
        (_, Kind::Silent) => (Vec::new(), Vec::new()),
        (Port::Master, Kind::SlowHeader) => (Vec::new(), [H2_PREFACE, &H2_SETTINGS].concat()),
        (Port::Master, Kind::SlowBody) => {
            ([H2_PREFACE, &H2_SETTINGS, &H2_DATA].concat(), vec![0; 256])
        }
        (_, Kind::SlowHeader) => {
            let method = if port == Port::AgentAdmin {
                "GET"
            } else {
                "POST"
            };
            let head = format!(
                "{method} {} HTTP/1.1\r\nHost: x\r\nX-Slow: {filler}",
                port.path()
            );
            (Vec::new(), head.into_bytes())
        }
        (_, Kind::SlowBody) => {
            let head = format!(
                "POST {} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: 1000000\r\n\r\n",
                port.path()
            );
            let body = format!(r#"{{"model":"{MODEL}","prompt":"{filler}"#);
            (head.into_bytes(), body.into_bytes())
        }
    }
}

/// How an attacker connection ended up.
enum Fate {
    /// The connection could not be made.
    Failed,
    /// The server closed it this long after the attack started.
    Closed(Duration),
    /// Still open when the attack stopped at the mark.
    Open(TcpStream),
}

/// A TCP connection from `from` to `to`.
async fn connect_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let s = TcpSocket::new_v4()?;
    s.bind(SocketAddr::new(IpAddr::V4(from), 0))?;
    let stream = s.connect(to).await?;
    stream.set_nodelay(true)?;
    Ok(stream)
}

/// One attacker: connects, sends its opening, then trickles its script while reading (and
/// dropping) whatever the server says, until the server closes the connection or `stop`.
async fn attacker(
    port: Port,
    kind: Kind,
    from: Ipv4Addr,
    to: SocketAddr,
    start: Instant,
    stop: CancellationToken,
) -> Fate {
    let Ok(mut s) = connect_from(from, to).await else {
        return Fate::Failed;
    };
    let (opening, trickle) = script(port, kind);
    if !opening.is_empty() && s.write_all(&opening).await.is_err() {
        return Fate::Closed(start.elapsed());
    }
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + TRICKLE, TRICKLE);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut next = trickle.iter();
    let mut buf = vec![0u8; 4096];
    loop {
        tokio::select! {
            biased;
            r = s.read(&mut buf) => match r {
                Ok(0) | Err(_) => return Fate::Closed(start.elapsed()),
                Ok(_) => {}
            },
            () = stop.cancelled() => return Fate::Open(s),
            _ = tick.tick() => {
                if let Some(&b) = next.next()
                    && s.write_all(&[b]).await.is_err()
                {
                    return Fate::Closed(start.elapsed());
                }
            }
        }
    }
}

/// Whether the server still holds `s`: a non-blocking read finds no end of file, no reset,
/// only nothing to read yet (what the server sent is read and dropped).
fn still_held(s: TcpStream) -> bool {
    let Ok(mut s) = s.into_std() else {
        return false;
    };
    let mut buf = [0u8; 4096];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return false,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
}

/// The ports under attack.
#[derive(Clone, Copy, Debug)]
struct Targets {
    conductor: SocketAddr,
    engine: SocketAddr,
    agent_admin: SocketAddr,
    master: SocketAddr,
}

impl Targets {
    fn of(&self, port: Port) -> SocketAddr {
        match port {
            Port::Conductor => self.conductor,
            Port::Engine => self.engine,
            Port::AgentAdmin => self.agent_admin,
            Port::Master => self.master,
        }
    }
}

/// One HTTP/1.1 exchange on a fresh connection from `from`: the reply, or what went wrong.
async fn http_from(
    from: Ipv4Addr,
    to: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> Result<kvpool_harness::http::Reply, String> {
    let call = kvpool_harness::http::Call {
        from: Some(IpAddr::V4(from)),
        ..kvpool_harness::http::Call::new(method, path, body)
    };
    kvpool_harness::http::call(to, call)
        .await
        .map_err(|e| e.to_string())
}

/// A completion of a short prompt at `to` from `from`; Ok when answered 200 with a choice.
async fn completion(from: Ipv4Addr, to: SocketAddr, n: usize) -> Result<(), String> {
    let body = format!(r#"{{"model":"{MODEL}","prompt":"campaign request {n}","max_tokens":2}}"#);
    let r = http_from(from, to, "POST", "/v1/completions", &body).await?;
    if r.status == 200 && r.body.contains("\"choices\"") {
        Ok(())
    } else {
        Err(format!("{} {}", r.status, r.body))
    }
}

/// The master's `Stats` over gRPC on a fresh connection from `from`, signed with the pool key.
/// From 127.0.0.1 through the pool's own client; from another address through a channel
/// whose socket is bound to it (the pool client cannot choose its source address).
async fn master_stats(from: Ipv4Addr, to: SocketAddr) -> Result<(), String> {
    if from == REAL {
        let client = pool_support::master_client(to, KEY);
        return client.stats().await.map(drop).map_err(|e| e.to_string());
    }
    let connector = tower::service_fn(move |_: http::Uri| async move {
        connect_from(from, to)
            .await
            .map(hyper_util::rt::TokioIo::new)
    });
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{to}"))
        .map_err(|e| e.to_string())?
        .timeout(REQUEST_TIMEOUT)
        .connect_with_connector(connector)
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let key = kvpool_proto::auth::AuthKey::from_bytes(KEY.as_bytes()).expect("pool key");
    let mut client = kvpool_proto::master::master_client::MasterClient::with_interceptor(
        channel,
        kvpool_proto::auth::Signer(key),
    );
    client
        .stats(kvpool_proto::master::Empty {})
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// One real request to `port` from `from`.
async fn request(port: Port, from: Ipv4Addr, targets: Targets, n: usize) -> Result<(), String> {
    let to = targets.of(port);
    match port {
        Port::Conductor | Port::Engine => completion(from, to, n).await,
        Port::AgentAdmin => {
            let r = http_from(from, to, "GET", "/readyz", "").await?;
            if r.status == 200 {
                Ok(())
            } else {
                Err(format!("{} {}", r.status, r.body))
            }
        }
        Port::Master => master_stats(from, to).await,
    }
}

/// A client's record: requests tried, the latencies of those that succeeded, the first error.
#[derive(Debug, Default)]
struct Tally {
    tried: usize,
    latencies: Vec<Duration>,
    first_error: Option<String>,
}

impl Tally {
    fn ok(&self) -> usize {
        self.latencies.len()
    }

    /// `ok=A/B p50=.. p99=.. max=..`
    fn summary(&self) -> String {
        let mut l = self.latencies.clone();
        l.sort_unstable();
        let at = |q: f64| {
            let i = ((q * l.len() as f64).ceil() as usize).clamp(1, l.len().max(1)) - 1;
            l.get(i).map_or("-".to_owned(), |d| format!("{d:.1?}"))
        };
        format!(
            "ok={}/{} p50={} p99={} max={}",
            self.ok(),
            self.tried,
            at(0.5),
            at(0.99),
            at(1.0)
        )
    }
}

/// A client on `from` making one request to `port` every [`EVERY`] until `until`.
async fn client(port: Port, from: Ipv4Addr, targets: Targets, until: Instant) -> Tally {
    let mut tally = Tally::default();
    let mut tick = tokio::time::interval(EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while Instant::now() < until {
        tick.tick().await;
        let n = tally.tried;
        tally.tried += 1;
        let started = Instant::now();
        let r = tokio::time::timeout(REQUEST_TIMEOUT, request(port, from, targets, n)).await;
        match r.unwrap_or_else(|_| Err(format!("no answer within {REQUEST_TIMEOUT:?}"))) {
            Ok(()) => tally.latencies.push(started.elapsed()),
            Err(e) => {
                tally
                    .first_error
                    .get_or_insert_with(|| format!("request {n}: {e}"));
            }
        }
    }
    tally
}

/// The attackers of one kind on one port.
struct KindReport {
    kind: Kind,
    attackers: usize,
    /// Connections that could not be made.
    failed: usize,
    /// When the server closed each one it closed before the mark, in order.
    closed: Vec<Duration>,
    /// Still held at the mark.
    held: usize,
}

/// One port's outcome.
struct PortReport {
    port: Port,
    kinds: Vec<KindReport>,
    real: Tally,
    shared: Tally,
}

impl PortReport {
    fn attackers(&self) -> usize {
        self.kinds.iter().map(|k| k.attackers).sum()
    }

    fn held(&self) -> usize {
        self.kinds.iter().map(|k| k.held).sum()
    }

    fn failed(&self) -> usize {
        self.kinds.iter().map(|k| k.failed).sum()
    }
}

/// The attack and the clients, from the start to the mark; the outcome per port.
async fn campaign(targets: Targets) -> Vec<PortReport> {
    let stop = CancellationToken::new();
    let start = Instant::now();
    let until = start + MARK;
    let mut attackers = Vec::with_capacity(ATTACKERS);
    for i in 0..ATTACKERS {
        let port = Port::ALL[i % 4];
        let from = SOURCES[(i / 4) % SOURCES.len()];
        let kind = Kind::ALL[(i / 16) % Kind::ALL.len()];
        let task = tokio::spawn(attacker(
            port,
            kind,
            from,
            targets.of(port),
            start,
            stop.clone(),
        ));
        attackers.push((port, kind, task));
    }
    // In the order of `Port::ALL`, as the reports are.
    let clients: Vec<_> = Port::ALL
        .iter()
        .map(|&port| {
            (
                tokio::spawn(client(port, REAL, targets, until)),
                tokio::spawn(client(port, SHARED, targets, until)),
            )
        })
        .collect();
    tokio::time::sleep_until(until.into()).await;
    stop.cancel();
    // Counted at the mark, before anything else is awaited.
    let mut reports: Vec<PortReport> = Port::ALL
        .iter()
        .map(|&port| PortReport {
            port,
            kinds: Kind::ALL
                .iter()
                .map(|&kind| KindReport {
                    kind,
                    attackers: 0,
                    failed: 0,
                    closed: Vec::new(),
                    held: 0,
                })
                .collect(),
            real: Tally::default(),
            shared: Tally::default(),
        })
        .collect();
    for (port, kind, task) in attackers {
        let fate = task.await.expect("attacker task");
        let k = reports
            .iter_mut()
            .filter(|r| r.port == port)
            .flat_map(|r| r.kinds.iter_mut())
            .find(|k| k.kind == kind)
            .expect("a report for each port and kind");
        k.attackers += 1;
        match fate {
            Fate::Failed => k.failed += 1,
            Fate::Closed(at) => k.closed.push(at),
            Fate::Open(s) => k.held += usize::from(still_held(s)),
        }
    }
    for k in reports.iter_mut().flat_map(|r| r.kinds.iter_mut()) {
        k.closed.sort_unstable();
    }
    for (r, (real, shared)) in reports.iter_mut().zip(clients) {
        r.real = real.await.expect("real client task");
        r.shared = shared.await.expect("shared-address client task");
    }
    reports
}

/// Raises the soft limit on open descriptors to the hard one when it is below `need`.
fn raise_fd_limit(need: u64) -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into `lim`, which lives across the call.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    assert_eq!(rc, 0, "getrlimit: {}", std::io::Error::last_os_error());
    if lim.rlim_cur >= need {
        return lim.rlim_cur;
    }
    assert!(
        lim.rlim_max >= need,
        "the campaign needs {need} open files; the hard limit (ulimit -Hn) is {}",
        lim.rlim_max
    );
    lim.rlim_cur = lim.rlim_max;
    // SAFETY: setrlimit reads one rlimit from `lim`, which lives across the call.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
    assert_eq!(rc, 0, "setrlimit: {}", std::io::Error::last_os_error());
    lim.rlim_cur
}

/// The processes under attack, killed on drop.
struct Stack {
    _dir: tempfile::TempDir,
    procs: Vec<ChildProcess>,
    targets: Targets,
}

impl Stack {
    /// Master, pool agent, synthetic engine and conductor, each once ready.
    fn start() -> Stack {
        let dir = tempfile::tempdir().expect("tempdir");
        let key_file = pool_support::write_key(dir.path(), KEY);
        let launcher = Launcher::new(dir.path());
        let addr = || free_addr().expect("port");
        let (engine_api, engine_admin) = (addr(), addr());
        let (conductor_api, conductor_admin) = (addr(), addr());
        let engine = launcher
            .spawn(
                "engine",
                kvpool_command(KVPOOL.as_ref())
                    .args(["engine", "--synthetic", "--time-scale", "0.001"])
                    .args(["--model", MODEL, "--block-size", BLOCK])
                    .args(["--listen", &engine_api.to_string()])
                    .args(["--admin-listen", &engine_admin.to_string()]),
            )
            .expect("spawn kvpool engine");
        let engine_url = format!("http://{engine_api}");
        let conductor = launcher
            .spawn(
                "conductor",
                kvpool_command(KVPOOL.as_ref())
                    .args(["conductor", "--model", MODEL, "--block-size", BLOCK])
                    .args(["--time-scale", "0.001"])
                    .args(["--prefill", &engine_url, "--decode", &engine_url])
                    .args(["--listen", &conductor_api.to_string()])
                    .args(["--admin-listen", &conductor_admin.to_string()]),
            )
            .expect("spawn kvpool conductor");
        let master = pool_support::start_master(dir.path(), &key_file, "10s", &[]);
        let (agent, agent_addrs) =
            pool_support::start_agent(dir.path(), "agent-a", master.grpc, &key_file, "16MiB");
        let mut procs = vec![master.process, agent, engine, conductor];
        for (p, admin) in
            procs[1..]
                .iter_mut()
                .zip([agent_addrs.admin, engine_admin, conductor_admin])
        {
            p.wait_ready(&Probe::readyz(admin), DEADLINE)
                .unwrap_or_else(|e| panic!("{} not ready: {e}", p.name()));
        }
        Stack {
            _dir: dir,
            procs,
            targets: Targets {
                conductor: conductor_api,
                engine: engine_api,
                agent_admin: agent_addrs.admin,
                master: master.grpc,
            },
        }
    }

    /// Panics with the log tail of any process that exited.
    fn assert_running(&mut self) {
        for p in &mut self.procs {
            if let Err(e) = p.assert_running() {
                panic!("{} exited during the campaign: {e}", p.name());
            }
        }
    }
}

/// `p50=.. max=..` of the times at which connections were cut.
fn cut_times(closed: &[Duration]) -> String {
    match (closed.get(closed.len() / 2), closed.last()) {
        (Some(p50), Some(max)) => format!("cut p50={p50:.1?} max={max:.1?}"),
        _ => "none cut".to_owned(),
    }
}

#[test]
fn slow_clients_from_four_addresses_are_cut_and_real_clients_are_served() {
    let fds = raise_fd_limit(FDS_NEEDED);
    let mut stack = Stack::start();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let reports = runtime.block_on(campaign(stack.targets));
    stack.assert_running();

    let mut held_total = 0;
    let mut failed_total = 0;
    for r in &reports {
        println!(
            "campaign {}: attackers={} held_after_{}s={} real_client {} shared_address {}",
            r.port.name(),
            r.attackers(),
            MARK.as_secs(),
            r.held(),
            r.real.summary(),
            r.shared.summary()
        );
        let kinds: Vec<String> = r
            .kinds
            .iter()
            .map(|k| {
                format!(
                    "{} held={}/{} connect_failed={} {}",
                    k.kind.name(),
                    k.held,
                    k.attackers,
                    k.failed,
                    cut_times(&k.closed)
                )
            })
            .collect();
        println!("campaign {} kinds: {}", r.port.name(), kinds.join("; "));
        held_total += r.held();
        failed_total += r.failed();
    }
    let attackers: usize = reports.iter().map(PortReport::attackers).sum();
    println!(
        "campaign total: attackers={attackers} from {}..={} held_after_{}s={held_total} \
         (at most {HELD_MAX}) connect_failed={failed_total} open-files limit {fds}",
        SOURCES[0],
        SOURCES[3],
        MARK.as_secs()
    );
    assert_eq!(attackers, ATTACKERS);
    assert!(
        held_total <= HELD_MAX,
        "{held_total} of {ATTACKERS} attacker connections still held after {MARK:?}"
    );
    for r in &reports {
        let name = r.port.name();
        // Throughout: a request at least every second on average, every one answered.
        assert!(
            r.real.tried >= MARK.as_secs() as usize,
            "{name}: the real client made only {} requests",
            r.real.tried
        );
        assert_eq!(
            r.real.ok(),
            r.real.tried,
            "{name}: the real client on {REAL} failed: {:?}",
            r.real.first_error
        );
        assert!(
            r.shared.ok() > 0,
            "{name}: the client on the attackers' address {SHARED} never succeeded: {:?}",
            r.shared.first_error
        );
    }
}
