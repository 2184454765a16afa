//! The shared HTTP serve loop (conductor front door, synthetic engines, admin ports) under slow
//! and silent clients on 127.0.0.1 (issues 15 and 38): a per-source cap where a new connection
//! evicts the oldest unproven one, a deadline for a request's head however slowly it trickles,
//! a deadline for its body however slowly that trickles, an idle timeout between requests;
//! real clients are served throughout, one on the attackers' own address too. Waits poll the
//! server's connection metrics, bounded in time.

#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::routing::{get, post};
use kvpool_runtime::http::{HttpLimits, HttpStats, serve_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

struct Server {
    addr: SocketAddr,
    stats: HttpStats,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn server(limits: HttpLimits) -> Server {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stats = HttpStats::new("test").unwrap();
    let stop = CancellationToken::new();
    let router = Router::new().route("/ok", get(|| async { "ok\n" })).route(
        "/echo",
        post(|b: Bytes| async move { format!("{}\n", b.len()) }),
    );
    let task = tokio::spawn(serve_with(
        listener,
        router,
        stop.clone(),
        limits,
        stats.clone(),
    ));
    Server {
        addr,
        stats,
        stop,
        task,
    }
}

async fn connect_from(ip: &str, to: SocketAddr) -> TcpStream {
    let s = tokio::net::TcpSocket::new_v4().unwrap();
    s.bind(format!("{ip}:0").parse().unwrap()).unwrap();
    s.connect(to).await.unwrap()
}

/// Poll `cond` every 10 ms for at most `limit`; whether it came true.
async fn eventually(limit: Duration, cond: impl FnMut() -> bool) -> bool {
    kvpool_harness::poll::until_async(limit, Duration::from_millis(10), cond).await
}

/// One GET /ok on a fresh connection from 127.0.0.1; the status line.
async fn real_get(addr: SocketAddr) -> String {
    let mut s = connect_from("127.0.0.1", addr).await;
    s.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    out.lines().next().unwrap_or_default().to_owned()
}

/// Read until the server closes; false if it did not within `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    let mut buf = [0u8; 1024];
    tokio::time::timeout(limit, async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    })
    .await
    .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_from_one_source_are_capped_and_cut_at_the_deadline() {
    let s = server(HttpLimits {
        header_read_timeout: Duration::from_millis(800),
        body_read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_secs(60),
        max_connections: 256,
        max_connections_per_source: 16,
    })
    .await;
    let start = Instant::now();
    // 40 connections from 127.0.0.2 start a request and send one more header byte every
    // 100 ms: 16 are held; each past the cap evicts the oldest (24 evicted, none refused).
    let mut attack = Vec::new();
    for _ in 0..40 {
        let mut c = connect_from("127.0.0.2", s.addr).await;
        c.write_all(b"GET /ok HTTP/1.1\r\nX-Slow: ").await.unwrap();
        attack.push(c);
    }
    let evicted = || s.stats.closed.with_label_values(&["evicted"]).get();
    assert!(
        eventually(Duration::from_secs(5), || evicted() == 24
            && s.stats.open.get() == 16)
        .await,
        "evicted {} open {}",
        evicted(),
        s.stats.open.get()
    );
    assert_eq!(s.stats.refused.with_label_values(&["per_source"]).get(), 0);
    let held = s.stats.open.get();
    let drip = tokio::spawn(async move {
        for _ in 0..30 {
            for c in &mut attack {
                let _ = c.write_all(b"a").await;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        attack
    });
    // A real client is served while they are held.
    let served = Instant::now();
    assert_eq!(real_get(s.addr).await, "HTTP/1.1 200 OK");
    let served = served.elapsed();
    assert!(served < Duration::from_secs(1), "{served:?}");
    // The drip does not keep them: all are cut at the head deadline.
    assert!(
        eventually(Duration::from_secs(5), || s.stats.open.get() == 0).await,
        "{} still open",
        s.stats.open.get()
    );
    let closed_after = start.elapsed();
    assert!(
        closed_after >= Duration::from_millis(800),
        "{closed_after:?}"
    );
    let cut = s.stats.closed.with_label_values(&["header_timeout"]).get();
    assert_eq!(cut, 16);
    let mut attack = drip.await.unwrap();
    for c in &mut attack {
        assert!(closed_within(c, Duration::from_secs(1)).await);
    }
    assert_eq!(real_get(s.addr).await, "HTTP/1.1 200 OK");
    println!(
        "figure: 40 slow-header connections from one source held {held} (cap 16), {} evicted by \
         newer ones; real GET served in {served:?}; all cut {closed_after:?} after the start \
         (deadline 800 ms)",
        evicted()
    );
    s.stop.cancel();
    s.task.await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn silent_and_idle_connections_are_closed_and_shutdown_is_not_held_up() {
    let s = server(HttpLimits {
        header_read_timeout: Duration::from_millis(500),
        body_read_timeout: Duration::from_secs(5),
        idle_timeout: Duration::from_millis(1500),
        max_connections: 20,
        max_connections_per_source: 20,
    })
    .await;
    // 10 connections that never send a byte, and one that makes a keep-alive request and
    // then stays idle.
    let mut silent = Vec::new();
    for _ in 0..10 {
        silent.push(connect_from("127.0.0.4", s.addr).await);
    }
    let mut idle = connect_from("127.0.0.5", s.addr).await;
    idle.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 256];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 200 OK"));
    let answered = Instant::now();
    for c in &mut silent {
        assert!(closed_within(c, Duration::from_secs(3)).await);
    }
    assert_eq!(
        s.stats.closed.with_label_values(&["header_timeout"]).get(),
        10
    );
    // The idle keep-alive connection outlives the head deadline and goes at the idle one.
    assert!(closed_within(&mut idle, Duration::from_secs(5)).await);
    let idle_for = answered.elapsed();
    // Kept past the 500 ms head deadline: closed for idleness (1.5 s), not as a slow head.
    assert!(idle_for >= Duration::from_millis(1000), "{idle_for:?}");
    assert_eq!(s.stats.closed.with_label_values(&["idle"]).get(), 1);
    // The total cap: 20 open at once; the 21st evicts the oldest silent one.
    let mut many = Vec::new();
    for i in 0..21 {
        many.push(connect_from(&format!("127.0.1.{i}"), s.addr).await);
    }
    assert!(
        eventually(Duration::from_secs(5), || s
            .stats
            .closed
            .with_label_values(&["evicted"])
            .get()
            == 1
            && s.stats.open.get() == 20)
        .await
    );
    assert!(
        closed_within(&mut many[0], Duration::from_secs(1)).await,
        "the oldest went"
    );
    // Shutdown with silent connections open ends within the head deadline.
    let stopping = Instant::now();
    s.stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), s.task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert!(stopping.elapsed() < Duration::from_secs(2));
    drop(many);
}

/// POST /echo with `body` on a fresh connection from `ip`; the status line and body.
async fn real_post(ip: &str, addr: SocketAddr, body: &[u8]) -> String {
    let mut s = connect_from(ip, addr).await;
    let head = format!(
        "POST /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body).await.unwrap();
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .unwrap()
        .unwrap();
    let status = out.lines().next().unwrap_or_default();
    let last = out.lines().last().unwrap_or_default();
    format!("{status} {last}")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_bodies_are_cut_and_a_client_on_the_attackers_address_is_served() {
    let s = server(HttpLimits {
        header_read_timeout: Duration::from_millis(700),
        body_read_timeout: Duration::from_millis(2000),
        idle_timeout: Duration::from_secs(60),
        max_connections: 256,
        max_connections_per_source: 16,
    })
    .await;
    let start = Instant::now();
    // 30 connections from 127.0.0.6 send a whole head announcing 100,000 body bytes, then one
    // body byte every 200 ms: never stalled, never done. 16 are held at once.
    let mut attack = Vec::new();
    for _ in 0..30 {
        let mut c = connect_from("127.0.0.6", s.addr).await;
        c.write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n")
            .await
            .unwrap();
        attack.push(c);
    }
    let drip = tokio::spawn(async move {
        for _ in 0..25 {
            for c in &mut attack {
                let _ = c.write_all(b"b").await;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        attack
    });
    assert!(
        eventually(Duration::from_secs(2), || s.stats.open.get() == 16).await,
        "open {}",
        s.stats.open.get()
    );
    // A real client elsewhere, and one on the attackers' own address, are served meanwhile.
    assert_eq!(
        real_post("127.0.0.1", s.addr, &[7; 5000]).await,
        "HTTP/1.1 200 OK 5000"
    );
    let same = Instant::now();
    assert_eq!(
        real_post("127.0.0.6", s.addr, &[7; 5000]).await,
        "HTTP/1.1 200 OK 5000"
    );
    let same = same.elapsed();
    assert!(same < Duration::from_secs(1), "{same:?}");
    // The trickle does not keep them: each is cut at the body deadline.
    assert!(
        eventually(Duration::from_secs(6), || s.stats.open.get() == 0).await,
        "{} still open",
        s.stats.open.get()
    );
    let cut_after = start.elapsed();
    assert!(cut_after >= Duration::from_millis(2000), "{cut_after:?}");
    let body_cut = s.stats.closed.with_label_values(&["body_timeout"]).get();
    assert!(body_cut >= 1, "cut for their bodies: {body_cut}");
    let mut attack = drip.await.unwrap();
    for c in &mut attack {
        assert!(closed_within(c, Duration::from_secs(1)).await);
    }
    println!(
        "figure: 30 slow-body connections from one source (1 byte per 200 ms of 100,000 \
         announced) held at most 16 (cap 16), {} evicted by newer ones, {body_cut} cut at the \
         2 s body deadline; a POST from another address and one from the attackers' own address \
         (served in {same:?}) succeeded; none left {cut_after:?} after the start",
        s.stats.closed.with_label_values(&["evicted"]).get()
    );
    s.stop.cancel();
    s.task.await.unwrap().unwrap();
}
