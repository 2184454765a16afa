"""vLLM's block hashes and KV events, written from vLLM's documented formats with hashlib,
cbor2, msgpack and pyzmq only (no kvpool code): the independent side of kvpool's tests.

Block hash (vLLM v1, --prefix-caching-hash-algo sha256_cbor): the seed is
sha256(cbor(PYTHONHASHSEED as text)); block i is sha256(cbor((parent, tuple(token_ids),
extra_keys))) over full blocks only, extra_keys None or (lora_name,). The integer form is the
hash's last 8 bytes, big-endian.

KV events: ZMQ PUB frames [topic, seq as 8 bytes big-endian, msgpack EventBatch], the batch
[ts, [event, ...], data_parallel_rank]; an event is a tagged array
["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium] or a map with "type".
Replay: a ROUTER answering [id, "", start_seq] with [id, "", seq, payload]... then
[id, "", -1 as 8 signed bytes, ""].

Run as a publisher: prints {"pub": port, "replay": port}, then reads one JSON command per line
on stdin and answers one JSON line (see handle())."""

import hashlib
import json
import sys
import time

import cbor2
import msgpack
import zmq

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def seed_hash(seed):
    return hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()


def block_hashes(tokens, block_size, seed="0", lora_name=None):
    parent = seed_hash(seed)
    extra = (lora_name,) if lora_name else None
    out = []
    for start in range(0, len(tokens) // block_size * block_size, block_size):
        block = tuple(tokens[start : start + block_size])
        parent = hashlib.sha256(cbor2.dumps((parent, block, extra), canonical=True)).digest()
        out.append(parent)
    return out


def as_int(h):
    return int.from_bytes(h[-8:], "big")


def stored(hashes, parent, tokens, block_size, encoding, medium="GPU"):
    if encoding == "map":
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                "token_ids": tokens, "block_size": block_size, "lora_id": None, "medium": medium}
    return ["BlockStored", hashes, parent, tokens, block_size, None, medium]


def removed(hashes, encoding, medium="GPU"):
    if encoding == "map":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    return ["BlockRemoved", hashes, medium]


class Publisher:
    def __init__(self):
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub_port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.replay = ctx.socket(zmq.ROUTER)
        self.replay_port = self.replay.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.buffer = []  # (seq, payload)

    def batch(self, events, rank=None, publish=True, keep=True):
        items = [time.time(), events] + ([rank] if rank is not None else [])
        payload = msgpack.packb(items, use_bin_type=True)
        seq = self.seq
        self.seq += 1
        if keep:
            self.buffer.append((seq, payload))
        if publish:
            self.pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"), payload])
        return seq

    def serve_replays(self):
        while self.replay.poll(0):
            ident, _, start = self.replay.recv_multipart()
            first = int.from_bytes(start, "big")
            for seq, payload in self.buffer:
                if seq >= first:
                    self.replay.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            self.replay.send_multipart([ident, b"", END_SEQ, b""])


def handle(p, cmd):
    op = cmd["op"]
    enc = cmd.get("encoding", "array")
    form = cmd.get("hash_form", "int")
    if op in ("store", "remove", "skip"):
        raw = block_hashes(cmd["tokens"], cmd["block_size"], cmd.get("seed", "0"))
        hashes = [as_int(h) if form == "int" else h for h in raw]
        if op == "remove":
            event = removed(hashes, enc)
        else:
            n = len(raw) * cmd["block_size"]
            event = stored(hashes, None, cmd["tokens"][:n], cmd["block_size"], enc)
        # skip: buffered for replay but not published (a lost message the replay recovers).
        seq = p.batch([event], rank=cmd.get("rank"), publish=op != "skip")
        return {"seq": seq, "hashes": [as_int(h) for h in raw]}
    if op == "drop":  # a sequence number lost for good (not even in the replay buffer)
        p.seq += 1
        return {"seq": p.seq - 1}
    if op == "clear":
        return {"seq": p.batch([["AllBlocksCleared"]])}
    if op == "probe":
        return {"seq": p.batch([])}
    if op == "restart":  # the engine restarted: it counts from 0 with an empty buffer
        p.seq = 0
        p.buffer = []
        return {"seq": 0}
    if op == "hashes":
        raw = block_hashes(cmd["tokens"], cmd["block_size"], cmd.get("seed", "0"),
                           cmd.get("lora_name"))
        return {"blocks": [{"hash_hex": h.hex(), "hash_u64": as_int(h)} for h in raw]}
    raise ValueError(f"unknown op {op}")


def main():
    p = Publisher()
    print(json.dumps({"pub": p.pub_port, "replay": p.replay_port}), flush=True)
    poller = zmq.Poller()
    poller.register(p.replay, zmq.POLLIN)
    while True:
        p.serve_replays()
        # Wait for a command, answering replays meanwhile.
        import select

        ready, _, _ = select.select([sys.stdin], [], [], 0.01)
        if not ready:
            continue
        line = sys.stdin.readline()
        if not line:
            return
        print(json.dumps(handle(p, json.loads(line))), flush=True)


if __name__ == "__main__":
    main()
