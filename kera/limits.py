"""Every size limit of kera, in one module, with their relations asserted at import.

A limit that is checked in one process and silently larger in another is how
a record gets accepted by a broker and then refused by every backup (the
vseg it sits in can never be replicated: a wedge). So each bound is defined
once here, the others are derived from it, and the chain

    largest chunk <= largest replicated payload <= largest frame payload

(and the same for every other message that carries chunks) is asserted
below. Anything over a limit is refused at the door, where it enters, with
a typed error naming the limit.
"""

from __future__ import annotations

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# -- frames (kera.frame) ---------------------------------------------------------
FRAME_PREFIX = 16                 # magic, version, kind, request id, meta length, payload length
MAX_FRAME = 64 * MiB              # one RPC frame, prefix + meta + payload
MAX_META = 4 * MiB                # its msgpack header (a pull reply's entries for many streamlets)
MAX_PAYLOAD = MAX_FRAME - FRAME_PREFIX - MAX_META

# -- chunks (kera.chunk) ------------------------------------------------------------
MAX_CHUNK = 16 * MiB              # one chunk, header included: the largest record is a little less
MAX_RECORDS = 1 << 24             # records in one chunk

# -- streams (coordinator) ---------------------------------------------------------
MIN_SEGMENT_SIZE = 4 * KiB
MAX_SEGMENT_SIZE = 256 * MiB      # a stream's segment size (a chunk larger than it is refused)
MAX_STREAMLETS = 4096             # per stream
MAX_GROUPS = 64                   # active groups per streamlet
# one create_streams request: its specs, its reply and each broker's assign all sit in one
# frame's meta, so the batch is bounded in streams and in streamlets over all its streams
MAX_BATCH_STREAMS = 4096
MAX_BATCH_STREAMLETS = 65536
BATCH_STREAM_BYTES = 512          # packed size of one stream's description, name of 249 included
BATCH_STREAMLET_BYTES = 16        # and of each of its streamlets (owner, index)
# one list_streams page: up to this many streams and streamlets (each described with its
# owner and address), after scanning at most MAX_LIST_SCAN names; the answer says where to go on
MAX_LIST_PAGE = 1024
MAX_LIST_PAGE_STREAMLETS = 32768
LIST_STREAMLET_BYTES = 48
MAX_LIST_SCAN = 65536

# -- producer requests (client, broker) ---------------------------------------------
MAX_REQUEST = 32 * MiB            # producer request.size is clamped to this
# a request carries up to request.size bytes of chunks, or one chunk if that alone is larger
MAX_PRODUCE_PAYLOAD = max(MAX_REQUEST, MAX_CHUNK)

# -- replication (vlog -> backup) -----------------------------------------------------
REPLICATE_BATCH = 8 * MiB         # one vseg copy's entry carries up to this, or one chunk if larger
# one replicate RPC carries the entries of every vseg copy a broker has for one backup (all its
# vlogs), up to this many bytes (or its first entry, if larger) and REPLICATE_ENTRIES entries:
# two full entries, so a backlog after a stall drains in few RPCs while the frame a backup holds
# and the time it spends verifying one request's checksums stay small
REPLICATE_RPC = 2 * REPLICATE_BATCH
REPLICATE_ENTRIES = 1024
# replicate messages one vseg copy may have out at once, and replicate RPCs one broker may have
# out to one backup: the next acknowledgement round leaves before the last one is answered
REPLICATE_INFLIGHT = 2
REPLICATE_ENTRY_META = 512        # an entry's description and its answer (a typed error's message)
MAX_REPLICATE_PAYLOAD = max(REPLICATE_RPC, MAX_CHUNK)
DEFAULT_VSEG_SIZE = 8 * MiB
MAX_VSEG_SIZE = 256 * MiB         # a virtual segment's capacity (broker --vseg-size)
# a virtual segment takes chunks while they fit, and always its first one
MAX_VSEG_BYTES = max(MAX_VSEG_SIZE, MAX_CHUNK)
MAX_REPLICA_BYTES = 1 * GiB       # what a backup accepts in one replica's chunk area

# -- a backup's holdings (kera.backup) -----------------------------------------------------
MAX_REPLICAS = 100_000            # replicas one backup holds at once
INDEX_CACHE = 64 * MiB            # closed replicas' indexes a backup keeps (80 bytes per chunk, 88
#                                   per run of chunks): a recovery's index needs no file read for them

# -- reads (backup read/replay, broker pull) ---------------------------------------------
MAX_READ = 8 * MiB                # a backup read reply, or one chunk if larger
DEFAULT_READ = 1 * MiB            # ... unless the read asks for less or more
REPLAY_READ = 4 * MiB             # a replay step: one read, one recover request per broker
MAX_PULL = 32 * MiB               # a pull reply: up to this, plus at most one chunk beyond it
DEFAULT_PULL = 1 * MiB            # ... unless the pull asks for less or more
TIERED_CACHE = 32 * MiB           # evicted segments' bytes a broker keeps read back for the next
#                                   pulls (an eighth of its memory budget, if that is less)
# a pull names at most this many streamlets (a plain pull's list, a session's additions and
# drops) and answers at most this many entries (so its meta fits a frame whatever it reads)
MAX_PULL_STREAMLETS = 32768
PULL_ENTRY_BYTES = 64             # packed size of a streamlet named in a pull, or of an entry
MAX_PULL_SESSIONS = 1024          # pull sessions a broker keeps (the least recently used goes)

# -- the transport (kera.rpc) ------------------------------------------------------------
MAX_INFLIGHT = 256                # requests of one connection a server runs at once (past it,
#                                   the connection is not read: backpressure)
RECV_SIZE = 1 * MiB               # bytes one receive takes from a socket
SERVE_SLICE = 0.05                # seconds of requests one connection runs before the others,
#                                   heartbeats and replication get a turn (a read of several
#                                   produce requests to fresh streamlets is ~1 s of work)
VECTOR_FROM = 64 * KiB            # a frame of parts this large goes out vectored (writev), not
VECTOR_PART = 4 * KiB             # joined first, when its parts average this much
TLS_RECORD = 16 * KiB             # the most plaintext one TLS record carries (RFC 8446)
TLS_PIECE = 256 * KiB             # plaintext whose ciphertext leaves in one buffer over TLS (one
#                                   write); that ciphertext is all a connection holds unsent
# -- the Kafka listener (kera.kafka) ---------------------------------------------------------
KAFKA_INFLIGHT = 256              # answers of one Kafka connection ready or waiting at once (past
#                                   it the connection is not read; librdkafka keeps up to
#                                   max.in.flight = 1,000,000 requests in flight when not idempotent)
KAFKA_RCVBUF = 102_400            # a Kafka connection's socket receive buffer: Kafka's own broker
#                                   default (socket.receive.buffer.bytes). Left to the kernel it
#                                   grows to 32 MiB here, and a producer's requests queue there
#                                   unanswered instead of in its accumulator, where they would
#                                   coalesce into bigger batches (librdkafka builds no new request
#                                   while one waits to be written: queue.buffering.backpressure.threshold)

# -- connections, at the door of every listener (kera.rpc) -------------------------------
MAX_CONNECTIONS = 10_000          # open connections per listener
MAX_CONNECTIONS_PER_ADDR = 1_000  # of those, from one peer address
IDLE_TIMEOUT = 600.0              # s a connection may sit with nothing in flight (Kafka's 10 min)
FRAME_TIMEOUT = 60.0              # s a frame begun may take to arrive whole (slow-read bound)
SEND_TIMEOUT = 60.0               # s a reply begun may wait for the peer to take it
HANDSHAKE_TIMEOUT = 30.0          # s from accept until a connection that must authenticate has
REPLY_BUDGET = 2 * MAX_FRAME      # bytes of replies queued for one connection: a peer that does
#                                   not read is cut off past it
RECEIVE_BUDGET = 512 * MiB        # bytes of large frames still arriving, over a listener's
#                                   connections: past it they wait (their FRAME_TIMEOUT runs on)
MAX_AUTH_BYTES = 4 * KiB          # one handshake message (a SCRAM step, a member's proof)
ACL_CACHE = 4096                  # ACL decisions a connection keeps (a listing asks one per stream)

# -- recovery (coordinator <-> backups, new owners; kera.recovery) --------------------------
INDEX_VSEGS = 256   # vsegs one backup index request may name (a recovery asks that many at a time)
INDEX_ANSWER = 16 * MiB           # bytes of rows and index chunks one index answer carries (its
#                                   first vseg's, whatever their size: the others are asked again)
INDEX_VERIFY = 256 * MiB          # file bytes one verified index answer reads back and checks (past
#                                   them the rest is put off, "later"), well inside its timeout
ADOPT_BATCH = 8 * MiB             # bytes of index chunks one adopt request carries, or one if larger
CHUNK_ROWS_NEWEST = 8 * MiB       # default of the coordinator's --chunk-rows-newest: bytes of each
#                                   vlog's newest settled vsegs a recovery plans from a row per chunk
MAX_PENDING_GROUPS = 1 << 20      # group ids one streamlet may wait for from one dead incarnation

# -- the coordinator's metadata ----------------------------------------------------------
MAX_METALOG_RECORD = 16 * MiB     # one record of the metadata log (a group-commit batch, or a part)
MAX_TXN_BYTES = 1 * MiB           # one etcd transaction's changes (etcd refuses a request over
ETCD_MAX_REQUEST = 3 * MiB // 2   # its --max-request-bytes, 1.5 MiB by default)

# -- the metrics endpoint (kera.metrics.endpoint) ------------------------------------------
METRICS_REQUEST = 16 * KiB        # bytes of a scrape's request head (a scrape's is a few hundred)

# -- the relations --------------------------------------------------------------------
assert KAFKA_INFLIGHT >= 1 and KAFKA_RCVBUF >= 64 * KiB, "room for a few 16 KiB batches"
assert MAX_CHUNK <= MAX_SEGMENT_SIZE, "a chunk must fit a segment of the largest size"
assert MAX_CHUNK <= MAX_REPLICATE_PAYLOAD <= MAX_PAYLOAD, "every chunk must be replicable"
assert max(REPLICATE_BATCH, MAX_CHUNK) <= MAX_REPLICATE_PAYLOAD, "every entry must fit a replicate"
assert REPLICATE_ENTRIES * REPLICATE_ENTRY_META <= MAX_META, \
    "every replicate and its answer must fit a frame's meta"
assert REPLICATE_INFLIGHT >= 1
assert MAX_VSEG_BYTES <= MAX_REPLICA_BYTES, "every virtual segment must fit a replica"
assert MAX_PRODUCE_PAYLOAD <= MAX_PAYLOAD, "every producer request must fit a frame"
assert max(MAX_READ, MAX_CHUNK) <= MAX_PAYLOAD, "every read reply must fit a frame"
assert max(REPLAY_READ, MAX_CHUNK) <= MAX_PAYLOAD, "every recover request must fit a frame"
assert MAX_PULL + MAX_CHUNK <= MAX_PAYLOAD, "every pull reply must fit a frame"
assert 2 * MAX_PULL_STREAMLETS * PULL_ENTRY_BYTES <= MAX_META, \
    "every pull request and its answer must fit a frame's meta"
assert MIN_SEGMENT_SIZE <= MAX_SEGMENT_SIZE
assert MAX_STREAMLETS <= MAX_BATCH_STREAMLETS, "a stream of the most streamlets must fit a batch"
assert (MAX_BATCH_STREAMS * BATCH_STREAM_BYTES + MAX_BATCH_STREAMLETS * BATCH_STREAMLET_BYTES
        <= MAX_META), "every create_streams request, reply and assign must fit a frame's meta"
assert MAX_STREAMLETS <= MAX_LIST_PAGE_STREAMLETS, "a stream of the most streamlets must fit a page"
assert (MAX_LIST_PAGE * BATCH_STREAM_BYTES + MAX_LIST_PAGE_STREAMLETS * LIST_STREAMLET_BYTES
        <= MAX_META), "every list_streams page must fit a frame's meta"
assert MAX_CONNECTIONS_PER_ADDR <= MAX_CONNECTIONS
assert TLS_RECORD <= TLS_PIECE and TLS_RECORD <= RECV_SIZE, "TLS moves whole records at once"
assert VECTOR_PART <= VECTOR_FROM <= MAX_FRAME
assert REPLY_BUDGET >= MAX_FRAME, "every reply must fit a connection's reply budget"
assert RECEIVE_BUDGET >= MAX_FRAME, "a frame of the largest size must be receivable"
assert FRAME_TIMEOUT <= IDLE_TIMEOUT and HANDSHAKE_TIMEOUT <= IDLE_TIMEOUT
assert MAX_AUTH_BYTES <= MAX_META
assert MAX_META < MAX_METALOG_RECORD, "every metadata change a request carries must fit a log record"
assert MAX_TXN_BYTES < ETCD_MAX_REQUEST, "every etcd transaction must be taken by a default etcd"
assert DEFAULT_READ <= MAX_READ and DEFAULT_PULL <= MAX_PULL
assert INDEX_ANSWER <= MAX_PAYLOAD, "every index answer's batch must fit a frame"
assert max(ADOPT_BATCH, MAX_CHUNK) <= MAX_PAYLOAD, "every adopt request must fit a frame"
assert MAX_PENDING_GROUPS < 1 << 32, "pending group ids are a streamlet's u32 group ids"
