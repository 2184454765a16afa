"""An independent consumer of KV cache events, written from vLLM's documented wire format
(vllm/distributed/kv_events.py; docs "KV cache events"), with pyzmq and msgpack only: it does
not import anything from kvpool.

Wire format, as vLLM publishes it:
- a ZMQ PUB socket sends multipart messages [topic, sequence, payload]: the sequence an 8-byte
  big-endian signed integer counting from 0, the payload a msgpack EventBatch
  [timestamp, [event, ...], data_parallel_rank];
- events are tagged arrays: ["BlockStored", block_hashes, parent_block_hash, token_ids,
  block_size, lora_id, medium, ...], ["BlockRemoved", block_hashes, medium, ...],
  ["AllBlocksCleared"] (or maps with a "type" key and the same field names);
- a ROUTER replay socket: a DEALER sends the 8-byte start sequence and receives
  [b"", sequence, payload] for each buffered batch from there on, then [b"", -1, b""].

Usage: pool_events_consumer.py PUB_ENDPOINT REPLAY_ENDPOINT TOPIC. Prints {"ready": true},
then answers one JSON command per stdin line with one JSON line:
- {"op": "collect", "stored": N, "removed": M, "timeout_ms": T, "settle_ms": S}: receive live
  batches until N stored and M removed block hashes were seen since the last collect (or T
  elapsed), then S more milliseconds; answers {"batches": [...]} with what arrived.
- {"op": "replay", "start": K, "timeout_ms": T}: ask the replay socket for every batch from
  sequence K on; answers {"batches": [...], "ended": bool}.
A batch is {"seq", "ts", "rank", "events": [...]}; an event is {"type", "hashes", "medium",
"parent", "token_ids", "block_size", "lora_id"}; an integer hash stays a number, a byte hash
becomes {"bytes": "<hex>"}.
"""

import json
import sys
import time

import msgpack
import zmq

STORED_FIELDS = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium"]
REMOVED_FIELDS = ["block_hashes", "medium"]


def hash_json(h):
    if isinstance(h, (bytes, bytearray)):
        return {"bytes": bytes(h).hex()}
    return h


def event_json(raw):
    if isinstance(raw, dict):
        kind = raw.get("type")
        fields = raw
    else:
        kind = raw[0]
        names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(kind, [])
        fields = dict(zip(names, raw[1:]))
    return {
        "type": kind,
        "hashes": [hash_json(h) for h in fields.get("block_hashes") or []],
        "medium": fields.get("medium"),
        "parent": hash_json(fields.get("parent_block_hash")),
        "token_ids": fields.get("token_ids"),
        "block_size": fields.get("block_size"),
        "lora_id": fields.get("lora_id"),
    }


def batch_json(seq_frame, payload):
    seq = int.from_bytes(seq_frame, "big", signed=True)
    batch = msgpack.unpackb(payload, raw=False)
    return {
        "seq": seq,
        "ts": batch[0],
        "events": [event_json(e) for e in batch[1]],
        "rank": batch[2] if len(batch) > 2 else None,
    }


def counts(batches):
    stored = removed = 0
    for b in batches:
        for e in b["events"]:
            if e["type"] == "BlockStored":
                stored += len(e["hashes"])
            elif e["type"] == "BlockRemoved":
                removed += len(e["hashes"])
    return stored, removed


def collect(sub, cmd):
    want = (cmd.get("stored", 0), cmd.get("removed", 0))
    deadline = time.monotonic() + cmd.get("timeout_ms", 20000) / 1000
    settle = cmd.get("settle_ms", 300) / 1000
    batches = []
    done_at = None
    while True:
        now = time.monotonic()
        if done_at is None:
            s, r = counts(batches)
            if (s >= want[0] and r >= want[1]) or now >= deadline:
                done_at = now + settle
        if done_at is not None and now >= done_at:
            return {"batches": batches}
        wait_ms = int(max(1, ((done_at or deadline) - now) * 1000))
        if sub.poll(min(wait_ms, 100)):
            topic, seq, payload = sub.recv_multipart()
            batches.append(batch_json(seq, payload))


def replay(ctx, endpoint, cmd):
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send(int(cmd.get("start", 0)).to_bytes(8, "big", signed=True))
    deadline = time.monotonic() + cmd.get("timeout_ms", 20000) / 1000
    batches = []
    ended = False
    while time.monotonic() < deadline:
        if not dealer.poll(100):
            continue
        frames = dealer.recv_multipart()
        # [b"", sequence, payload]; the empty delimiter may be missing.
        if len(frames) == 3:
            frames = frames[1:]
        seq, payload = frames
        if int.from_bytes(seq, "big", signed=True) == -1:
            ended = True
            break
        batches.append(batch_json(seq, payload))
    dealer.close()
    return {"batches": batches, "ended": ended}


def main():
    pub_endpoint, replay_endpoint, topic = sys.argv[1], sys.argv[2], sys.argv[3]
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
    sub.connect(pub_endpoint)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "collect":
            out = collect(sub, cmd)
        elif cmd["op"] == "replay":
            out = replay(ctx, replay_endpoint, cmd)
        else:
            out = {"error": "unknown op %r" % cmd["op"]}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
