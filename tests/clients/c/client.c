/* A small C client of the rollfleet frontend socket, written from PROTOCOL.md.
 *
 * Library part (rf_*): connect a DEALER socket, send generate / abort / stats / control,
 * receive and validate messages, read chunks, results and error replies.
 * CLI part:  rfclient run ADDRESS < script     one JSON line printed per script line
 *            rfclient golden DIR NAME...       decode the golden vectors, print them as JSON
 * The script language is the Node client's (tests/clients/node/client.js, top comment).
 * Build: make (writes build/rfclient), or cc -O2 -o rfclient client.c -lzmq -lmsgpackc
 */
#include <inttypes.h>
#include <msgpack.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#define RF_PROTOCOL_VERSION 1
#define RF_TIMEOUT_MS 60000

typedef struct {
    void *ctx;
    void *sock;
} rf_client;

/* One received message. Fields point into `data`, which the message owns. */
typedef struct {
    char *data;
    size_t size;
    msgpack_unpacked up;
    const msgpack_object *root, *type, *id;
} rf_message;

/* The sampling map of a generate (PROTOCOL.md, "The sampling map"). */
typedef struct {
    int64_t max_tokens, top_k, seed;
    double temperature, top_p;
    int has_seed, ignore_eos, logprobs;
    const int64_t *stop_token_ids;
    size_t num_stop_token_ids;
} rf_sampling;

#define RF_SAMPLING_DEFAULTS {.max_tokens = 16, .temperature = 1.0, .top_p = 1.0}

static void die(const char *what) {
    fprintf(stderr, "rfclient: %s\n", what);
    exit(1);
}

/* ------------------------------------------------------------------ msgpack helpers */

static int str_eq(const msgpack_object *o, const char *s) {
    size_t n = strlen(s);
    return o && o->type == MSGPACK_OBJECT_STR && o->via.str.size == n && memcmp(o->via.str.ptr, s, n) == 0;
}

static const msgpack_object *map_get(const msgpack_object *map, const char *key) {
    if (!map || map->type != MSGPACK_OBJECT_MAP) return NULL;
    for (uint32_t i = 0; i < map->via.map.size; i++)
        if (str_eq(&map->via.map.ptr[i].key, key)) return &map->via.map.ptr[i].val;
    return NULL;
}

static int is_int(const msgpack_object *o) {
    return o && (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER || o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER);
}

static int64_t int_of(const msgpack_object *o, int64_t dflt) {
    if (!is_int(o)) return dflt;
    return o->type == MSGPACK_OBJECT_POSITIVE_INTEGER ? (int64_t)o->via.u64 : o->via.i64;
}

static void pack_str(msgpack_packer *pk, const char *s) {
    size_t n = strlen(s);
    msgpack_pack_str(pk, n);
    msgpack_pack_str_body(pk, s, n);
}

/* Every header starts with v, type, id; `num_fields` more key/value pairs follow. */
static void pack_header(msgpack_packer *pk, const char *type, const char *id, size_t num_fields) {
    msgpack_pack_map(pk, 3 + num_fields);
    pack_str(pk, "v");
    msgpack_pack_int(pk, RF_PROTOCOL_VERSION);
    pack_str(pk, "type");
    pack_str(pk, type);
    pack_str(pk, "id");
    pack_str(pk, id);
}

/* ------------------------------------------------------------------ encoding */

static void pack_bool(msgpack_packer *pk, int value) {
    if (value) msgpack_pack_true(pk); else msgpack_pack_false(pk);
}

/* A generate with every field written, in PROTOCOL.md order (so byte-identical to the golden
 * vector). session_id NULL and resume < 0 are sent as nil. */
void rf_encode_generate(msgpack_sbuffer *buf, const char *id, const int64_t *prompt, size_t n,
                        const rf_sampling *s, int stream, const char *session_id, int resume) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
    pack_header(&pk, "generate", id, 5);
    pack_str(&pk, "prompt_ids");
    msgpack_pack_array(&pk, n);
    for (size_t i = 0; i < n; i++) msgpack_pack_int64(&pk, prompt[i]);
    pack_str(&pk, "sampling");
    msgpack_pack_map(&pk, 8);
    pack_str(&pk, "max_tokens");
    msgpack_pack_int64(&pk, s->max_tokens);
    pack_str(&pk, "temperature");
    msgpack_pack_double(&pk, s->temperature);
    pack_str(&pk, "top_p");
    msgpack_pack_double(&pk, s->top_p);
    pack_str(&pk, "top_k");
    msgpack_pack_int64(&pk, s->top_k);
    pack_str(&pk, "seed");
    if (s->has_seed) msgpack_pack_int64(&pk, s->seed); else msgpack_pack_nil(&pk);
    pack_str(&pk, "stop_token_ids");
    msgpack_pack_array(&pk, s->num_stop_token_ids);
    for (size_t i = 0; i < s->num_stop_token_ids; i++) msgpack_pack_int64(&pk, s->stop_token_ids[i]);
    pack_str(&pk, "ignore_eos");
    pack_bool(&pk, s->ignore_eos);
    pack_str(&pk, "logprobs");
    pack_bool(&pk, s->logprobs);
    pack_str(&pk, "stream");
    pack_bool(&pk, stream);
    pack_str(&pk, "session_id");
    if (session_id) pack_str(&pk, session_id); else msgpack_pack_nil(&pk);
    pack_str(&pk, "resume");
    if (resume >= 0) pack_bool(&pk, resume); else msgpack_pack_nil(&pk);
}

void rf_encode_abort(msgpack_sbuffer *buf, const char *id, const char *request_id) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
    pack_header(&pk, "abort", id, 1);
    pack_str(&pk, "request_id");
    pack_str(&pk, request_id);
}

void rf_encode_stats(msgpack_sbuffer *buf, const char *id) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
    pack_header(&pk, "stats", id, 0);
}

/* A control op; its args map holds `num_args` string values (enough for every op today). */
void rf_encode_control(msgpack_sbuffer *buf, const char *id, const char *op, const char *const *keys,
                       const char *const *values, size_t num_args) {
    msgpack_packer pk;
    msgpack_packer_init(&pk, buf, msgpack_sbuffer_write);
    pack_header(&pk, "control", id, 2);
    pack_str(&pk, "op");
    pack_str(&pk, op);
    pack_str(&pk, "args");
    msgpack_pack_map(&pk, num_args);
    for (size_t i = 0; i < num_args; i++) {
        pack_str(&pk, keys[i]);
        pack_str(&pk, values[i]);
    }
}

/* ------------------------------------------------------------------ socket */

int rf_connect(rf_client *c, const char *address) {
    int timeout = RF_TIMEOUT_MS, linger = 0;
    c->ctx = zmq_ctx_new();
    c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
    zmq_setsockopt(c->sock, ZMQ_RCVTIMEO, &timeout, sizeof timeout);
    zmq_setsockopt(c->sock, ZMQ_LINGER, &linger, sizeof linger);
    return zmq_connect(c->sock, address);
}

void rf_close(rf_client *c) {
    zmq_close(c->sock);
    zmq_ctx_term(c->ctx);
}

/* (header,): a DEALER sends one frame per message; the ROUTER adds the identity itself. */
int rf_send(rf_client *c, const void *data, size_t size) {
    return zmq_send(c->sock, data, size, 0) < 0 ? -1 : 0;
}

/* Parse one header frame: exactly one msgpack map with v == 1 and string type and id. */
int rf_parse(rf_message *m, const char *data, size_t size) {
    size_t off = 0;
    m->data = malloc(size ? size : 1);
    memcpy(m->data, data, size);
    m->size = size;
    msgpack_unpacked_init(&m->up);
    if (msgpack_unpack_next(&m->up, m->data, size, &off) != MSGPACK_UNPACK_SUCCESS || off != size) return -1;
    m->root = &m->up.data;
    m->type = map_get(m->root, "type");
    m->id = map_get(m->root, "id");
    if (m->root->type != MSGPACK_OBJECT_MAP || int_of(map_get(m->root, "v"), -1) != RF_PROTOCOL_VERSION) return -1;
    if (!m->type || m->type->type != MSGPACK_OBJECT_STR || !m->id || m->id->type != MSGPACK_OBJECT_STR) return -1;
    return 0;
}

void rf_free(rf_message *m) {
    msgpack_unpacked_destroy(&m->up);
    free(m->data);
}

/* Receive the next valid message: (header, *buffers), extra frames are dropped. */
int rf_recv(rf_client *c, rf_message *m) {
    for (;;) {
        zmq_msg_t frame;
        int more = 0;
        size_t more_size = sizeof more;
        zmq_msg_init(&frame);
        if (zmq_msg_recv(&frame, c->sock, 0) < 0) {
            zmq_msg_close(&frame);
            return -1;
        }
        int bad = rf_parse(m, zmq_msg_data(&frame), zmq_msg_size(&frame));
        zmq_msg_close(&frame);
        zmq_getsockopt(c->sock, ZMQ_RCVMORE, &more, &more_size);
        while (more) {
            zmq_msg_init(&frame);
            zmq_msg_recv(&frame, c->sock, 0);
            zmq_msg_close(&frame);
            zmq_getsockopt(c->sock, ZMQ_RCVMORE, &more, &more_size);
        }
        if (!bad) return 0;
        fprintf(stderr, "rfclient: dropped a bad message\n");
        rf_free(m);
    }
}

/* ------------------------------------------------------------------ JSON output */

static void json_str(const char *p, size_t n) {
    putchar('"');
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)p[i];
        if (ch == '"' || ch == '\\') printf("\\%c", ch);
        else if (ch < 0x20) printf("\\u%04x", ch);
        else putchar(ch);
    }
    putchar('"');
}

/* Any msgpack value as JSON, with the golden-vector conventions: bin -> {"$bin": hex},
 * floats always with a fraction or exponent so they stay floats. */
static void json_value(const msgpack_object *o) {
    char num[40];
    switch (o->type) {
    case MSGPACK_OBJECT_NIL: printf("null"); break;
    case MSGPACK_OBJECT_BOOLEAN: printf(o->via.boolean ? "true" : "false"); break;
    case MSGPACK_OBJECT_POSITIVE_INTEGER: printf("%" PRIu64, o->via.u64); break;
    case MSGPACK_OBJECT_NEGATIVE_INTEGER: printf("%" PRId64, o->via.i64); break;
    case MSGPACK_OBJECT_FLOAT32:
    case MSGPACK_OBJECT_FLOAT64:
        snprintf(num, sizeof num, "%.17g", o->via.f64);
        if (!strpbrk(num, ".eEn")) strcat(num, ".0");
        printf("%s", num);
        break;
    case MSGPACK_OBJECT_STR: json_str(o->via.str.ptr, o->via.str.size); break;
    case MSGPACK_OBJECT_BIN:
        printf("{\"$bin\": \"");
        for (uint32_t i = 0; i < o->via.bin.size; i++) printf("%02x", (unsigned char)o->via.bin.ptr[i]);
        printf("\"}");
        break;
    case MSGPACK_OBJECT_ARRAY:
        putchar('[');
        for (uint32_t i = 0; i < o->via.array.size; i++) {
            if (i) putchar(',');
            json_value(&o->via.array.ptr[i]);
        }
        putchar(']');
        break;
    case MSGPACK_OBJECT_MAP:
        putchar('{');
        for (uint32_t i = 0; i < o->via.map.size; i++) {
            if (i) putchar(',');
            json_value(&o->via.map.ptr[i].key);
            putchar(':');
            json_value(&o->via.map.ptr[i].val);
        }
        putchar('}');
        break;
    default: printf("null"); break; /* ext: not used by rollfleet */
    }
}

/* The value of map[key] as JSON, or `dflt` (JSON text) when the key is absent. */
static void json_get(const msgpack_object *map, const char *key, const char *dflt) {
    const msgpack_object *o = map_get(map, key);
    if (o) json_value(o); else printf("%s", dflt);
}

static void json_field(const msgpack_object *map, const char *key, const char *dflt) {
    printf("\"%s\":", key);
    json_get(map, key, dflt);
}

/* The fields a caller needs from a result (the timings' values vary from run to run). */
static void json_result(const msgpack_object *m) {
    printf("{");
    json_field(m, "token_ids", "[]");
    putchar(',');
    json_field(m, "finish_reason", "null");
    putchar(',');
    json_field(m, "logprobs", "null");
    putchar(',');
    json_field(m, "weight_versions", "[]");
    putchar(',');
    json_field(m, "num_preemptions", "0");
    putchar(',');
    json_field(m, "worker", "\"\"");
    printf(",\"timings\":[");
    const msgpack_object *t = map_get(m, "timings");
    for (uint32_t i = 0; t && t->type == MSGPACK_OBJECT_MAP && i < t->via.map.size; i++) {
        if (i) putchar(',');
        json_value(&t->via.map.ptr[i].key);
    }
    printf("]}");
}

static void json_error(const msgpack_object *m) {
    printf("{");
    json_field(m, "code", "null");
    putchar(',');
    json_field(m, "message", "\"\"");
    putchar(',');
    json_field(m, "request_id", "null");
    printf("}");
}

/* ------------------------------------------------------------------ CLI: run */

static size_t parse_tokens(const char *text, int64_t *out, size_t cap) {
    size_t n = 0;
    if (strcmp(text, "-") == 0) return 0;
    for (const char *p = text; *p && n < cap;) {
        out[n++] = strtoll(p, (char **)&p, 10);
        if (*p == ',') p++;
    }
    return n;
}

/* Wait for the answer (reply or error) to call `id`; prints it as "reply"/"error". */
static void await_call(rf_client *c, const char *id) {
    rf_message m;
    for (;;) {
        if (rf_recv(c, &m) < 0) die("no answer from the fleet (timeout)");
        if (str_eq(m.id, id) && (str_eq(m.type, "reply") || str_eq(m.type, "error"))) break;
        rf_free(&m);
    }
    if (str_eq(m.type, "reply")) {
        printf("\"reply\":");
        json_get(m.root, "data", "{}");
        rf_free(&m);
        return;
    }
    printf("\"error\":");
    json_error(m.root);
    rf_free(&m);
}

/* generate (and abort_after: stream, send an abort after `abort_after` chunks). */
static void run_generate(rf_client *c, const char *cmd, const char *id, int abort_after, const int64_t *prompt,
                         size_t n, const rf_sampling *s, int stream) {
    msgpack_sbuffer buf;
    rf_message m;
    int num_chunks = 0, abort_sent = 0, abort_done = abort_after < 0, done = 0;
    char call_id[64];
    snprintf(call_id, sizeof call_id, "abort-%s", id);
    msgpack_sbuffer_init(&buf);
    rf_encode_generate(&buf, id, prompt, n, s, stream, NULL, -1);
    if (rf_send(c, buf.data, buf.size) < 0) die("send failed");
    msgpack_sbuffer_destroy(&buf);
    printf("{\"cmd\":\"%s\",\"id\":", cmd);
    json_str(id, strlen(id));
    printf(",\"chunks\":[");
    /* Chunks, the result and the abort's answer arrive interleaved; each is told by its id. */
    rf_message answer = {0};
    while (!done || !abort_done) {
        if (rf_recv(c, &m) < 0) die("no answer from the fleet (timeout)");
        if (abort_sent && str_eq(m.id, call_id) && (str_eq(m.type, "reply") || str_eq(m.type, "error"))) {
            answer = m; /* printed after the chunk list; freed there */
            answer.root = &answer.up.data;
            abort_done = 1;
            continue;
        }
        if (str_eq(m.id, id) && str_eq(m.type, "chunk")) {
            if (num_chunks++) putchar(',');
            json_value(map_get(m.root, "token_ids"));
            if (abort_after >= 0 && !abort_sent && num_chunks == abort_after) {
                msgpack_sbuffer_init(&buf);
                rf_encode_abort(&buf, call_id, id);
                if (rf_send(c, buf.data, buf.size) < 0) die("send failed");
                msgpack_sbuffer_destroy(&buf);
                abort_sent = 1;
            }
        } else if (str_eq(m.id, id) && (str_eq(m.type, "result") || str_eq(m.type, "error"))) {
            int ok = str_eq(m.type, "result");
            printf(ok ? "],\"result\":" : "],\"error\":");
            if (ok) json_result(m.root); else json_error(m.root);
            done = 1;
            if (!abort_sent) abort_done = 1; /* it ended before the abort was due */
        }
        rf_free(&m);
    }
    if (abort_after >= 0) {
        printf(",\"abort\":");
        if (!abort_sent) {
            printf("null");
        } else if (str_eq(answer.type, "reply")) {
            printf("{\"reply\":");
            json_get(answer.root, "data", "{}");
            printf("}");
        } else {
            printf("{\"error\":");
            json_error(answer.root);
            printf("}");
        }
        if (abort_sent) rf_free(&answer);
    }
    printf("}\n");
}

static int hexval(int ch) {
    return ch <= '9' ? ch - '0' : (ch | 0x20) - 'a' + 10;
}

static void run_line(rf_client *c, char *line, int *next_call) {
    char *words[64];
    int nw = 0;
    for (char *w = strtok(line, " \t\r\n"); w && nw < 64; w = strtok(NULL, " \t\r\n")) words[nw++] = w;
    if (nw == 0 || words[0][0] == '#') return;
    const char *cmd = words[0];
    char id[64];
    snprintf(id, sizeof id, "call-%d", (*next_call)++);
    msgpack_sbuffer buf;
    msgpack_sbuffer_init(&buf);
    if (strcmp(cmd, "generate") == 0 || strcmp(cmd, "abort_after") == 0) {
        int is_abort = cmd[0] == 'a';
        rf_sampling s = RF_SAMPLING_DEFAULTS;
        s.temperature = 0.0; /* scripts are greedy unless they say otherwise */
        int stream = is_abort, first_opt = is_abort ? 4 : 3;
        int64_t prompt[4096];
        if (nw < first_opt) die("generate needs: ID [N] PROMPT");
        size_t n = parse_tokens(words[first_opt - 1], prompt, 4096);
        for (int i = first_opt; i < nw; i++) {
            char *eq = strchr(words[i], '=');
            if (!eq) die("options are KEY=VALUE");
            *eq = '\0';
            const char *k = words[i], *v = eq + 1;
            if (!strcmp(k, "max_tokens")) s.max_tokens = strtoll(v, NULL, 10);
            else if (!strcmp(k, "temperature")) s.temperature = strtod(v, NULL);
            else if (!strcmp(k, "top_p")) s.top_p = strtod(v, NULL);
            else if (!strcmp(k, "top_k")) s.top_k = strtoll(v, NULL, 10);
            else if (!strcmp(k, "seed")) { s.seed = strtoll(v, NULL, 10); s.has_seed = 1; }
            else if (!strcmp(k, "stream")) stream = atoi(v);
            else die("unknown option");
        }
        run_generate(c, cmd, words[1], is_abort ? atoi(words[2]) : -1, prompt, n, &s, stream);
    } else if (strcmp(cmd, "abort") == 0 && nw == 2) {
        rf_encode_abort(&buf, id, words[1]);
        if (rf_send(c, buf.data, buf.size) < 0) die("send failed");
        printf("{\"cmd\":\"abort\",\"request_id\":");
        json_str(words[1], strlen(words[1]));
        putchar(',');
        await_call(c, id);
        printf("}\n");
    } else if (strcmp(cmd, "stats") == 0) {
        rf_encode_stats(&buf, id);
        if (rf_send(c, buf.data, buf.size) < 0) die("send failed");
        printf("{\"cmd\":\"stats\",");
        await_call(c, id);
        printf("}\n");
    } else if (strcmp(cmd, "control") == 0 && nw == 2) {
        rf_encode_control(&buf, id, words[1], NULL, NULL, 0);
        if (rf_send(c, buf.data, buf.size) < 0) die("send failed");
        printf("{\"cmd\":\"control\",\"op\":");
        json_str(words[1], strlen(words[1]));
        putchar(',');
        await_call(c, id);
        printf("}\n");
    } else if (strcmp(cmd, "raw") == 0 && nw == 3) {
        /* raw EXPECT_ID HEX: send bytes as they are; EXPECT_ID "-" means the empty id */
        size_t len = strlen(words[2]) / 2;
        char *bytes = malloc(len + 1);
        for (size_t i = 0; i < len; i++) bytes[i] = (char)(hexval(words[2][2 * i]) * 16 + hexval(words[2][2 * i + 1]));
        if (rf_send(c, bytes, len) < 0) die("send failed");
        free(bytes);
        const char *want = strcmp(words[1], "-") == 0 ? "" : words[1];
        rf_message m;
        for (;;) {
            if (rf_recv(c, &m) < 0) die("no answer from the fleet (timeout)");
            if (str_eq(m.id, want)) break;
            rf_free(&m);
        }
        printf("{\"cmd\":\"raw\",\"answer\":");
        json_value(m.root);
        printf("}\n");
        rf_free(&m);
    } else {
        die("unknown script command");
    }
    msgpack_sbuffer_destroy(&buf);
    fflush(stdout);
}

/* ------------------------------------------------------------------ CLI: golden */

static char *read_file(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    *size = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    char *data = malloc(*size ? *size : 1);
    if (fread(data, 1, *size, f) != *size) *size = 0;
    fclose(f);
    return data;
}

static char *cstr(const msgpack_object *o, char *out, size_t cap) {
    snprintf(out, cap, "%.*s", o && o->type == MSGPACK_OBJECT_STR ? (int)o->via.str.size : 0,
             o && o->type == MSGPACK_OBJECT_STR ? o->via.str.ptr : "");
    return out;
}

/* Re-encode the types this client sends from their decoded fields: 1 if the bytes are
 * identical to the vector, 0 if not, -1 for types this client does not send. */
static int encodes_same(const rf_message *m) {
    msgpack_sbuffer buf;
    char id[256], a[256], b[256], op[256];
    msgpack_sbuffer_init(&buf);
    cstr(m->id, id, sizeof id);
    if (str_eq(m->type, "generate")) {
        const msgpack_object *p = map_get(m->root, "prompt_ids"), *sp = map_get(m->root, "sampling");
        const msgpack_object *stop = map_get(sp, "stop_token_ids"), *sess = map_get(m->root, "session_id");
        const msgpack_object *resume = map_get(m->root, "resume");
        int64_t prompt[256], stops[256];
        size_t n = p->via.array.size < 256 ? p->via.array.size : 256;
        for (size_t i = 0; i < n; i++) prompt[i] = int_of(&p->via.array.ptr[i], 0);
        rf_sampling s = RF_SAMPLING_DEFAULTS;
        s.max_tokens = int_of(map_get(sp, "max_tokens"), 16);
        s.temperature = map_get(sp, "temperature")->via.f64;
        s.top_p = map_get(sp, "top_p")->via.f64;
        s.top_k = int_of(map_get(sp, "top_k"), 0);
        s.has_seed = is_int(map_get(sp, "seed"));
        s.seed = int_of(map_get(sp, "seed"), 0);
        s.num_stop_token_ids = stop->via.array.size < 256 ? stop->via.array.size : 256;
        for (size_t i = 0; i < s.num_stop_token_ids; i++) stops[i] = int_of(&stop->via.array.ptr[i], 0);
        s.stop_token_ids = stops;
        s.ignore_eos = map_get(sp, "ignore_eos")->via.boolean;
        s.logprobs = map_get(sp, "logprobs")->via.boolean;
        rf_encode_generate(&buf, id, prompt, n, &s, map_get(m->root, "stream")->via.boolean,
                           sess && sess->type == MSGPACK_OBJECT_STR ? cstr(sess, a, sizeof a) : NULL,
                           resume && resume->type == MSGPACK_OBJECT_BOOLEAN ? resume->via.boolean : -1);
    } else if (str_eq(m->type, "abort")) {
        rf_encode_abort(&buf, id, cstr(map_get(m->root, "request_id"), a, sizeof a));
    } else if (str_eq(m->type, "stats")) {
        rf_encode_stats(&buf, id);
    } else if (str_eq(m->type, "control")) {
        const msgpack_object *args = map_get(m->root, "args");
        const char *keys[1] = {a}, *values[1] = {b};
        size_t num_args = args->via.map.size; /* the vector has one string arg */
        if (num_args) {
            cstr(&args->via.map.ptr[0].key, a, sizeof a);
            cstr(&args->via.map.ptr[0].val, b, sizeof b);
        }
        rf_encode_control(&buf, id, cstr(map_get(m->root, "op"), op, sizeof op), keys, values, num_args);
    } else {
        msgpack_sbuffer_destroy(&buf);
        return -1;
    }
    int same = buf.size == m->size && memcmp(buf.data, m->data, m->size) == 0;
    msgpack_sbuffer_destroy(&buf);
    return same;
}

static int golden(const char *dir, int argc, char **names) {
    int failures = 0;
    for (int i = 0; i < argc; i++) {
        char path[4096];
        size_t size = 0;
        rf_message m;
        snprintf(path, sizeof path, "%s/%s.msgpack", dir, names[i]);
        char *data = read_file(path, &size);
        if (!data) die("cannot read a golden vector");
        int bad = rf_parse(&m, data, size);
        free(data);
        printf("{\"name\":\"%s\",\"valid\":%s,\"decoded\":", names[i], bad ? "false" : "true");
        if (bad) printf("null"); else json_value(m.root);
        int enc = bad ? -1 : encodes_same(&m);
        printf(",\"encodes_same\":%s}\n", enc < 0 ? "null" : enc ? "true" : "false");
        if (bad || enc == 0) failures++;
        rf_free(&m);
    }
    return failures ? 1 : 0;
}

int main(int argc, char **argv) {
    if (argc >= 3 && strcmp(argv[1], "golden") == 0) return golden(argv[2], argc - 3, argv + 3);
    if (argc == 3 && strcmp(argv[1], "run") == 0) {
        rf_client c;
        char line[1 << 16];
        int next_call = 1;
        if (rf_connect(&c, argv[2]) != 0) die("cannot connect");
        while (fgets(line, sizeof line, stdin)) run_line(&c, line, &next_call);
        rf_close(&c);
        return 0;
    }
    fprintf(stderr, "usage: rfclient run ADDRESS < script | rfclient golden DIR NAME...\n");
    return 2;
}
