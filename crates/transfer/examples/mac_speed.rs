//! Speed of the candidates for per-frame integrity (docs/transfer.md "Per-frame integrity")
//! over records of the size the lanes use: AES-256-GCM encrypting the record in place (what
//! `seal` uses), AES-256-GCM as a MAC over the record (GMAC, the older MAC-only format),
//! ChaCha20-Poly1305 both ways (ring), HMAC-SHA256 (ring) and HMAC-SHA256 (the `hmac`/`sha2`
//! crates the handshake uses). Run: `cargo run --release -p kvpool-transfer
//! --example mac_speed [record bytes] [seconds per candidate]`; prints GB/s per candidate.

use std::time::{Duration, Instant};

use hmac::{KeyInit, Mac};
use ring::aead::{AES_256_GCM, Aad, Algorithm, CHACHA20_POLY1305, LessSafeKey, Nonce, UnboundKey};

fn aead_tagger(alg: &'static Algorithm) -> impl FnMut(&[u8]) -> u8 {
    let key = LessSafeKey::new(UnboundKey::new(alg, &[7u8; 32]).expect("32-byte key"));
    let mut seq = 0u64;
    move |record| {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&seq.to_le_bytes());
        seq += 1;
        let tag = key
            .seal_in_place_separate_tag(Nonce::assume_unique_for_key(n), Aad::from(record), &mut [])
            .expect("tag");
        tag.as_ref()[0]
    }
}

/// Encrypt `record` in place and tag it (what `seal` does with a record).
fn aead_sealer(alg: &'static Algorithm, len: usize) -> impl FnMut(&[u8]) -> u8 {
    let key = LessSafeKey::new(UnboundKey::new(alg, &[7u8; 32]).expect("32-byte key"));
    let mut seq = 0u64;
    let mut buf = vec![0u8; len];
    move |record| {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&seq.to_le_bytes());
        seq += 1;
        buf.copy_from_slice(record);
        let tag = key
            .seal_in_place_separate_tag(
                Nonce::assume_unique_for_key(n),
                Aad::from(&[0u8; 4]),
                &mut buf,
            )
            .expect("tag");
        tag.as_ref()[0]
    }
}

fn measure(name: &str, record: &[u8], secs: f64, mut tag: impl FnMut(&[u8]) -> u8) {
    let start = Instant::now();
    let mut bytes = 0u64;
    let mut sink = 0u8;
    while start.elapsed() < Duration::from_secs_f64(secs) {
        for _ in 0..16 {
            sink ^= tag(record);
            bytes += record.len() as u64;
        }
    }
    let gbps = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
    println!("{name:<28} {gbps:7.3} GB/s  (sink {sink})");
}

fn main() {
    let mut args = std::env::args().skip(1);
    let len: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(256 * 1024);
    let secs: f64 = args.next().and_then(|a| a.parse().ok()).unwrap_or(2.0);
    let record: Vec<u8> = (0..len).map(|i| i as u8).collect();
    println!("record of {len} bytes, {secs} s per candidate");
    measure(
        "aes-256-gcm encrypt (copy+seal)",
        &record,
        secs,
        aead_sealer(&AES_256_GCM, len),
    );
    measure(
        "chacha20-poly1305 encrypt",
        &record,
        secs,
        aead_sealer(&CHACHA20_POLY1305, len),
    );
    measure(
        "aes-256-gcm (gmac, ring)",
        &record,
        secs,
        aead_tagger(&AES_256_GCM),
    );
    measure(
        "chacha20-poly1305 (ring)",
        &record,
        secs,
        aead_tagger(&CHACHA20_POLY1305),
    );
    let rkey = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &[7u8; 32]);
    measure("hmac-sha256 (ring)", &record, secs, |r| {
        ring::hmac::sign(&rkey, r).as_ref()[0]
    });
    let ckey = <hmac::Hmac<sha2::Sha256> as KeyInit>::new_from_slice(&[7u8; 32]).expect("key");
    measure("hmac-sha256 (hmac/sha2)", &record, secs, |r| {
        let mut m = ckey.clone();
        m.update(r);
        m.finalize().into_bytes()[0]
    });
    let mut dst = vec![0u8; len];
    measure("memcpy (reference)", &record, secs, |r| {
        dst.copy_from_slice(r);
        dst[len / 2]
    });
}
