/*
 * wanem: a userspace WAN emulator between two TUN devices.
 *
 * It creates one TUN device inside each of two network namespaces and forwards IP packets
 * between them, per direction: bottleneck rate (serialization time), drop-tail queue
 * (bytes and/or packets), random loss (seeded, per MSS-sized segment) and one-way delay.
 *
 * Speed: with offloads on (the default) the TUN devices carry virtio-net headers and accept
 * TSO/checksum offload, so the kernel hands over TCP super-packets of up to 64 KiB while the
 * MTU (and MSS) stay those of a real path. Loss and the queue still act per segment: when a
 * segment of a super-packet is lost or does not fit the queue, the super-packet is split
 * into the surviving runs of segments. One thread per direction; each keeps its packets in
 * a preallocated byte ring ordered by release time (delay is constant, so FIFO == time order).
 *
 * Control: prints "READY" on stdout once both devices exist; SIGUSR1 writes counters as JSON
 * to --stats; SIGTERM/SIGINT write them and exit. Exits by itself when its parent dies.
 * Needs CAP_NET_ADMIN and CAP_SYS_ADMIN (root).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <linux/virtio_net.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MAXPKT (65536 + 1024)   /* largest packet read from a TUN device (vnet hdr + IP) */
#define ALIGN 64
#define BATCH 64                /* packets read per wakeup before releasing due ones */
#define MAXSEGS 1024            /* segments handled individually per super-packet */
#define WRAP UINT32_MAX

struct ent {                    /* ring entry header; the packet follows */
    double t_dep;               /* ns: last bit leaves the bottleneck */
    uint64_t t_rel;             /* ns: written to the far TUN device */
    uint32_t len;               /* packet bytes (with vnet header), or WRAP */
    uint32_t segs;              /* segments it counts as in the queue */
    uint32_t wire;              /* IP bytes on the wire (headers per segment) */
    uint32_t pad;
};
#define HDR ((sizeof(struct ent) + ALIGN - 1) / ALIGN * ALIGN)

struct cfg {
    double delay_ms, rate_mbit, loss;
    uint64_t qbytes, qpkts;     /* 0 = no limit of that kind */
};

struct stats {
    uint64_t rx_pkts, rx_bytes, rx_segs, tx_pkts, tx_bytes, tx_segs, tx_err;
    uint64_t drop_loss, drop_queue, drop_ring, splits, bad_csum, max_qbytes;
};

struct dir {
    const char *name;
    int in_fd, out_fd;
    struct cfg c;
    uint64_t delay_ns;
    double ns_per_byte;         /* 0 = unlimited rate */
    uint64_t loss_thresh;       /* drop when rng() < loss_thresh */
    int loss_all;
    uint64_t rng;
    uint8_t *ring;
    size_t cap, head, tail, used, ser;
    uint64_t qents, qbytes, qpkts;
    double last_dep;
    struct stats st;            /* written by the worker only; read with relaxed atomics */
    uint8_t scratch[MAXPKT];
};

static int vnet = 1;            /* TUN devices carry struct virtio_net_hdr */
static const char *stats_path;

static void die(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fputs("wanem: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    exit(2);
}

static inline uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline uint64_t rng_next(uint64_t *s)   /* splitmix64 */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline int lost(struct dir *d)
{
    if (d->loss_all)
        return 1;
    return d->loss_thresh && rng_next(&d->rng) < d->loss_thresh;
}

#define ADD(field, v) __atomic_store_n(&d->st.field, d->st.field + (v), __ATOMIC_RELAXED)

/* ---- ring: variable-size entries, FIFO; a WRAP entry sends readers back to offset 0 ---- */

static inline struct ent *ent_at(struct dir *d, size_t off) { return (struct ent *)(d->ring + off); }

/* Offset where an entry of `need` bytes would go, or -1 when full; *wrap says a WRAP marker
 * must be committed first. Nothing changes until ring_commit. */
static long ring_slot(struct dir *d, size_t need, int *wrap)
{
    *wrap = 0;
    if (d->used == 0) {
        d->head = d->tail = d->ser = 0;
        return need <= d->cap ? 0 : -1;
    }
    if (d->tail > d->head) {
        if (d->cap - d->tail >= need)
            return (long)d->tail;
        if (d->head >= need) {
            *wrap = 1;
            return 0;
        }
        return -1;
    }
    if (d->tail < d->head && d->head - d->tail >= need)
        return (long)d->tail;
    return -1;
}

static void ring_commit(struct dir *d, int wrap, size_t size)
{
    if (wrap) {
        ent_at(d, d->tail)->len = WRAP;
        d->used += d->cap - d->tail;
        d->tail = 0;
    }
    d->used += size;
    d->tail += size;
    if (d->tail == d->cap)
        d->tail = 0;
}

static inline size_t ent_size(uint32_t len) { return (HDR + len + ALIGN - 1) / ALIGN * ALIGN; }

/* ---- packet parsing and splitting ---- */

static uint16_t csum16(const uint8_t *p, size_t n, uint32_t sum)
{
    for (; n > 1; p += 2, n -= 2)
        sum += (uint32_t)p[0] << 8 | p[1];
    if (n)
        sum += (uint32_t)p[0] << 8;
    while (sum >> 16)
        sum = (sum & 0xffff) + (sum >> 16);
    return (uint16_t)sum;
}

static inline uint16_t get16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static inline void put16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static inline uint32_t get32(const uint8_t *p) { return (uint32_t)get16(p) << 16 | get16(p + 2); }
static inline void put32(uint8_t *p, uint32_t v) { put16(p, (uint16_t)(v >> 16)); put16(p + 2, (uint16_t)v); }

/* Pseudo-header sum that a NEEDS_CSUM TCP packet carries in its checksum field. */
static uint16_t tcp_pseudo(const uint8_t *ip, uint32_t tcplen)
{
    uint32_t sum = csum16(ip + 12, 8, 0) + 6 + tcplen;
    while (sum >> 16)
        sum = (sum & 0xffff) + (sum >> 16);
    return (uint16_t)sum;
}

struct tso {                    /* a TCP/IPv4 super-packet */
    uint32_t hl;                /* IP + TCP header bytes */
    uint32_t mss, n, dlen;      /* segment payload size, segment count, payload bytes */
};

static int parse_tso(const uint8_t *pkt, uint32_t len, struct tso *t)
{
    const struct virtio_net_hdr *vh = (const void *)pkt;
    const uint8_t *ip = pkt + sizeof(*vh);
    uint32_t iplen = len - (uint32_t)sizeof(*vh), ihl, thl;
    if ((vh->gso_type & ~VIRTIO_NET_HDR_GSO_ECN) != VIRTIO_NET_HDR_GSO_TCPV4 || vh->gso_size == 0)
        return 0;
    if (iplen < 40 || (ip[0] >> 4) != 4 || ip[9] != 6)
        return 0;
    ihl = (ip[0] & 15u) * 4;
    if (ihl < 20 || iplen < ihl + 20)
        return 0;
    thl = (ip[ihl + 12] >> 4) * 4u;
    if (thl < 20 || iplen < ihl + thl)
        return 0;
    t->hl = ihl + thl;
    t->mss = vh->gso_size;
    t->dlen = iplen - t->hl;
    t->n = (t->dlen + t->mss - 1) / t->mss;
    return t->n >= 1;
}

/* Write segments [a, b) of super-packet `src` as one packet at `dst`; returns its length. */
static uint32_t build_piece(uint8_t *dst, const uint8_t *src, const struct tso *t,
                            uint32_t a, uint32_t b)
{
    const size_t vl = sizeof(struct virtio_net_hdr);
    uint32_t off = a * t->mss, end = b * t->mss < t->dlen ? b * t->mss : t->dlen;
    uint32_t plen = end - off, ihl = (src[vl] & 15u) * 4;
    struct virtio_net_hdr *vh = (void *)dst;
    uint8_t *ip = dst + vl, *th = ip + ihl;

    memcpy(dst, src, vl + t->hl);
    memcpy(dst + vl + t->hl, src + vl + t->hl + off, plen);
    if (b - a == 1) {
        vh->gso_type = VIRTIO_NET_HDR_GSO_NONE;
        vh->gso_size = 0;
    }
    put16(ip + 2, (uint16_t)(t->hl + plen));
    put16(ip + 4, (uint16_t)(get16(ip + 4) + a));
    put16(ip + 10, 0);
    put16(ip + 10, (uint16_t)~csum16(ip, ihl, 0));
    put32(th + 4, get32(th + 4) + off);
    if (a > 0)
        th[13] &= (uint8_t)~0x80;          /* CWR only on the first segment */
    if (b < t->n)
        th[13] &= (uint8_t)~0x09;          /* FIN, PSH only on the last */
    if (vh->flags & VIRTIO_NET_HDR_F_NEEDS_CSUM)
        put16(th + 16, tcp_pseudo(ip, t->hl - ihl + plen));
    return (uint32_t)vl + t->hl + plen;
}

/* Append one entry. With src == NULL the packet was read in place into the slot that
 * ring_slot(ent_size(MAXPKT)) gives; otherwise it is copied (or, with t, built) from src. */
static int put_ent(struct dir *d, const uint8_t *src, uint32_t len, double t_dep, uint32_t segs,
                   uint32_t wire, const struct tso *t, uint32_t a, uint32_t b)
{
    int wrap;
    long pos = ring_slot(d, ent_size(src ? len : MAXPKT), &wrap);
    struct ent *e;
    if (pos < 0)
        return -1;
    e = ent_at(d, (size_t)pos);
    if (t)
        len = build_piece((uint8_t *)e + HDR, src, t, a, b);
    else if (src)
        memcpy((uint8_t *)e + HDR, src, len);
    e->t_dep = t_dep;
    e->t_rel = (uint64_t)t_dep + d->delay_ns;
    e->len = len;
    e->segs = segs;
    e->wire = wire;
    ring_commit(d, wrap, ent_size(len));
    d->qents++;
    d->qbytes += wire;
    d->qpkts += segs;
    if (d->qbytes > d->st.max_qbytes)
        __atomic_store_n(&d->st.max_qbytes, d->qbytes, __ATOMIC_RELAXED);
    return 0;
}

static inline int fits(struct dir *d, uint64_t qb, uint64_t qp, uint32_t wire)
{
    if (d->ns_per_byte == 0)
        return 1;
    return (!d->c.qbytes || qb + wire <= d->c.qbytes) && (!d->c.qpkts || qp + 1 <= d->c.qpkts);
}

/* A packet of `len` bytes was read into the ring slot at `pos` (header space before it). */
static void admit(struct dir *d, long pos, uint32_t len, uint64_t now)
{
    uint8_t *pkt = (uint8_t *)ent_at(d, (size_t)pos) + HDR;
    uint32_t vl = vnet ? (uint32_t)sizeof(struct virtio_net_hdr) : 0;
    struct tso t;
    int is_tso = vnet && len > vl && parse_tso(pkt, len, &t) && t.n <= MAXSEGS && t.n > 1;
    uint32_t n = is_tso ? t.n : 1;
    double start = d->last_dep > (double)now ? d->last_dep : (double)now;
    uint8_t keep[MAXSEGS];
    double dep[MAXSEGS];
    uint32_t wire[MAXSEGS], kept = 0, i;
    uint64_t qb = d->qbytes, qp = d->qpkts;

    ADD(rx_pkts, 1);
    ADD(rx_bytes, len);
    ADD(rx_segs, n);
    for (i = 0; i < n; i++) {
        wire[i] = is_tso ? t.hl + (i + 1 < n ? t.mss : t.dlen - i * t.mss) : len - vl;
        keep[i] = 0;
        if (lost(d)) {
            ADD(drop_loss, 1);
        } else if (!fits(d, qb, qp, wire[i])) {
            ADD(drop_queue, 1);
        } else {
            keep[i] = 1;
            kept++;
            qb += wire[i];
            qp++;
            start += wire[i] * d->ns_per_byte;
        }
        dep[i] = start;
    }
    if (kept == 0)
        return;
    if (kept == n) {                                  /* common case: forward as read */
        uint32_t w = 0;
        for (i = 0; i < n; i++)
            w += wire[i];
        if (put_ent(d, NULL, len, dep[n - 1], n, w, NULL, 0, 0) == 0)
            d->last_dep = dep[n - 1];
        else
            ADD(drop_ring, n);
        return;
    }
    /* split into runs of kept segments; work from a copy since pieces reuse the slot */
    if (is_tso) {
        struct virtio_net_hdr *vh = (void *)pkt;
        const uint8_t *ip = pkt + vl;
        if ((vh->flags & VIRTIO_NET_HDR_F_NEEDS_CSUM) &&
            get16(ip + ((ip[0] & 15u) * 4) + 16) != tcp_pseudo(ip, len - vl - (ip[0] & 15u) * 4))
            ADD(bad_csum, 1);
    }
    memcpy(d->scratch, pkt, len);
    ADD(splits, 1);
    for (i = 0; i < n;) {
        uint32_t j = i, w = 0;
        if (!keep[i]) {
            i++;
            continue;
        }
        while (j < n && keep[j])
            w += wire[j++];
        if (put_ent(d, d->scratch, len, dep[j - 1], j - i, w, is_tso ? &t : NULL, i, j) == 0)
            d->last_dep = dep[j - 1];
        else
            ADD(drop_ring, j - i);
        i = j;
    }
}

/* ---- per-direction worker ---- */

static void serialize(struct dir *d, uint64_t now)
{
    while (d->qents) {
        struct ent *e = ent_at(d, d->ser);
        if (e->len == WRAP) {
            d->ser = 0;
            continue;
        }
        if (e->t_dep > (double)now)
            break;
        d->qbytes -= e->wire;
        d->qpkts -= e->segs;
        d->qents--;
        d->ser += ent_size(e->len);
        if (d->ser == d->cap)
            d->ser = 0;
    }
}

static void release(struct dir *d, uint64_t now)
{
    while (d->used) {
        struct ent *e = ent_at(d, d->head);
        if (e->len == WRAP) {
            d->used -= d->cap - d->head;
            d->head = 0;
            continue;
        }
        if (e->t_rel > now)
            break;
        if (write(d->out_fd, (uint8_t *)e + HDR, e->len) == (ssize_t)e->len) {
            ADD(tx_pkts, 1);
            ADD(tx_bytes, e->len);
            ADD(tx_segs, e->segs);
        } else {
            if (d->st.tx_err == 0)
                fprintf(stderr, "wanem: %s: write: %s\n", d->name, strerror(errno));
            ADD(tx_err, 1);
        }
        d->used -= ent_size(e->len);
        d->head += ent_size(e->len);
        if (d->head == d->cap)
            d->head = 0;
    }
}

static void *worker(void *arg)
{
    struct dir *d = arg;
    prctl(PR_SET_TIMERSLACK, 50000UL);   /* coalesce release wakeups: <= 50 us late */
    for (;;) {
        uint64_t now = now_ns();
        int n = 0;
        serialize(d, now);
        release(d, now);
        while (n < BATCH) {
            int wrap;
            long pos = ring_slot(d, ent_size(MAXPKT), &wrap);
            uint8_t *buf = pos < 0 ? d->scratch : (uint8_t *)ent_at(d, (size_t)pos) + HDR;
            ssize_t r = read(d->in_fd, buf, MAXPKT);
            if (r < 0) {
                if (errno == EAGAIN || errno == EINTR)
                    break;
                die("%s: read: %s", d->name, strerror(errno));
            }
            n++;
            if (r <= (vnet ? (ssize_t)sizeof(struct virtio_net_hdr) : 0) || r >= MAXPKT)
                continue;                        /* empty, truncated or malformed: dropped */
            if (pos < 0) {
                ADD(rx_pkts, 1);
                ADD(drop_ring, 1);
                continue;
            }
            now = now_ns();
            serialize(d, now);
            admit(d, pos, (uint32_t)r, now);     /* commits via put_ent (same slot) */
        }
        if (n == BATCH)
            continue;
        {
            struct pollfd p = {.fd = d->in_fd, .events = POLLIN};
            struct timespec ts, *tp = NULL;
            now = now_ns();
            if (d->used) {
                struct ent *e = ent_at(d, d->head);
                uint64_t t = e->len == WRAP ? now : e->t_rel, dt = t > now ? t - now : 0;
                ts.tv_sec = (time_t)(dt / 1000000000ull);
                ts.tv_nsec = (long)(dt % 1000000000ull);
                tp = &ts;
            }
            if (ppoll(&p, 1, tp, NULL) < 0 && errno != EINTR)
                die("%s: ppoll: %s", d->name, strerror(errno));
        }
    }
    return NULL;
}

/* ---- setup ---- */

static int open_tun(const char *nspath, const char *dev)
{
    int self = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    int ns = open(nspath, O_RDONLY | O_CLOEXEC), fd;
    struct ifreq ifr;
    if (self < 0 || ns < 0)
        die("open %s: %s", ns < 0 ? nspath : "own netns", strerror(errno));
    if (setns(ns, CLONE_NEWNET) < 0)
        die("setns %s: %s (needs root)", nspath, strerror(errno));
    fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        die("open /dev/net/tun: %s", strerror(errno));
    memset(&ifr, 0, sizeof(ifr));
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (vnet ? IFF_VNET_HDR : 0);
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", dev);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0)
        die("TUNSETIFF %s in %s: %s", dev, nspath, strerror(errno));
    if (vnet && ioctl(fd, TUNSETOFFLOAD, (unsigned long)(TUN_F_CSUM | TUN_F_TSO4)) < 0)
        die("TUNSETOFFLOAD: %s", strerror(errno));
    if (setns(self, CLONE_NEWNET) < 0)
        die("setns back: %s", strerror(errno));
    close(self);
    close(ns);
    return fd;
}

static void init_dir(struct dir *d, const char *name, int in, int out, struct cfg c, uint64_t seed,
                     double ring_mb)
{
    double rate_Bps = c.rate_mbit * 1e6 / 8, bytes;
    d->name = name;
    d->in_fd = in;
    d->out_fd = out;
    d->c = c;
    d->delay_ns = (uint64_t)llround(c.delay_ms * 1e6);
    d->ns_per_byte = c.rate_mbit > 0 ? 1e9 / rate_Bps : 0;
    d->loss_all = c.loss >= 1.0;
    d->loss_thresh = c.loss > 0 && c.loss < 1.0 ? (uint64_t)ldexp(c.loss, 64) : 0;
    d->rng = seed;
    if (ring_mb <= 0) {                              /* bytes in flight + queue, with slack */
        double r = c.rate_mbit > 0 ? rate_Bps : 20e9 / 8;   /* unlimited: size for 20 Gbit/s */
        bytes = 1.5 * r * c.delay_ms / 1e3 + 2.0 * (double)c.qbytes + 8e6;
        if (c.qpkts)
            bytes += 2.0 * (double)c.qpkts * 1600;
        if (bytes > 1024e6)
            bytes = 1024e6;
    } else {
        bytes = ring_mb * 1e6;
    }
    d->cap = ((size_t)bytes + ALIGN - 1) / ALIGN * ALIGN;
    d->ring = aligned_alloc(4096, (d->cap + 4095) / 4096 * 4096);
    if (!d->ring)
        die("cannot allocate %zu-byte ring", d->cap);
    memset(d->ring, 0, d->cap);                      /* fault the pages in now, not mid-run */
}

static void json_dir(FILE *f, struct dir *d)
{
    struct stats s;
#define L(x) s.x = __atomic_load_n(&d->st.x, __ATOMIC_RELAXED)
    L(rx_pkts); L(rx_bytes); L(rx_segs); L(tx_pkts); L(tx_bytes); L(tx_segs); L(tx_err);
    L(drop_loss); L(drop_queue); L(drop_ring); L(splits); L(bad_csum); L(max_qbytes);
#undef L
    fprintf(f,
            "{\"rx_pkts\": %lu, \"rx_bytes\": %lu, \"rx_segs\": %lu, \"tx_pkts\": %lu, "
            "\"tx_bytes\": %lu, \"tx_segs\": %lu, \"tx_err\": %lu, \"drop_loss\": %lu, "
            "\"drop_queue\": %lu, \"drop_ring\": %lu, \"splits\": %lu, \"bad_csum\": %lu, "
            "\"max_qbytes\": %lu, \"ring_bytes\": %zu}",
            s.rx_pkts, s.rx_bytes, s.rx_segs, s.tx_pkts, s.tx_bytes, s.tx_segs, s.tx_err,
            s.drop_loss, s.drop_queue, s.drop_ring, s.splits, s.bad_csum, s.max_qbytes, d->cap);
}

static void write_stats(struct dir *ab, struct dir *ba)
{
    char tmp[4096];
    FILE *f;
    if (!stats_path)
        return;
    snprintf(tmp, sizeof(tmp), "%s.tmp", stats_path);
    f = fopen(tmp, "w");
    if (!f)
        return;
    fprintf(f, "{\"ab\": ");
    json_dir(f, ab);
    fprintf(f, ", \"ba\": ");
    json_dir(f, ba);
    fprintf(f, "}\n");
    fclose(f);
    rename(tmp, stats_path);
}

static double num(const char *opt, const char *s, double lo, double hi)
{
    char *end;
    double v = strtod(s, &end);
    if (*s == 0 || *end != 0 || !(v >= lo && v <= hi))
        die("--%s: expected a number in [%g, %g], got '%s'", opt, lo, hi, s);
    return v;
}

static void usage(void)
{
    fputs("usage: wanem --ns-a NSPATH --ns-b NSPATH [--dev NAME] [--dev-b NAME] [--stats FILE] [--seed N]\n"
          "             [--parent PID] [--ring-mb MB] [--no-offload]\n"
          "             [--{delay-ms,rate-mbit,loss,queue-bytes,queue-pkts}-{ab,ba} V]...\n"
          "a->b is traffic sent from namespace A; rate 0 = unlimited; queue 0 = no limit.\n"
          "--dev names the device in both namespaces (default wan0), --dev-b the one in B.\n",
          stderr);
    exit(2);
}

int main(int argc, char **argv)
{
    static struct dir ab, ba;
    struct cfg cab = {0}, cba = {0};
    const char *ns_a = NULL, *ns_b = NULL, *dev = "wan0", *dev_b = NULL;
    uint64_t seed = 1;
    long parent = 0;
    double ring_mb = 0;
    int fa, fb, sig;
    pthread_t t1, t2;
    sigset_t set;
    enum { O_NSA = 256, O_NSB, O_DEV, O_DEVB, O_STATS, O_SEED, O_PARENT, O_RING, O_NOOFF, O_DIR };
    static const struct option opts[] = {
        {"ns-a", 1, 0, O_NSA}, {"ns-b", 1, 0, O_NSB}, {"dev", 1, 0, O_DEV}, {"dev-b", 1, 0, O_DEVB},
        {"stats", 1, 0, O_STATS}, {"seed", 1, 0, O_SEED}, {"parent", 1, 0, O_PARENT},
        {"ring-mb", 1, 0, O_RING}, {"no-offload", 0, 0, O_NOOFF},
        {"delay-ms-ab", 1, 0, O_DIR + 0}, {"rate-mbit-ab", 1, 0, O_DIR + 1},
        {"loss-ab", 1, 0, O_DIR + 2}, {"queue-bytes-ab", 1, 0, O_DIR + 3},
        {"queue-pkts-ab", 1, 0, O_DIR + 4},
        {"delay-ms-ba", 1, 0, O_DIR + 5}, {"rate-mbit-ba", 1, 0, O_DIR + 6},
        {"loss-ba", 1, 0, O_DIR + 7}, {"queue-bytes-ba", 1, 0, O_DIR + 8},
        {"queue-pkts-ba", 1, 0, O_DIR + 9}, {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        struct cfg *c = o >= O_DIR + 5 ? &cba : &cab;
        const char *name = o >= O_DIR ? opts[9 + o - O_DIR].name : "";
        switch (o) {
        case O_NSA: ns_a = optarg; break;
        case O_NSB: ns_b = optarg; break;
        case O_DEV: dev = optarg; break;
        case O_DEVB: dev_b = optarg; break;
        case O_STATS: stats_path = optarg; break;
        case O_SEED: seed = (uint64_t)num("seed", optarg, 0, 9e15); break;
        case O_PARENT: parent = (long)num("parent", optarg, 1, 4194304); break;
        case O_RING: ring_mb = num("ring-mb", optarg, 1, 65536); break;
        case O_NOOFF: vnet = 0; break;
        case O_DIR + 0: case O_DIR + 5: c->delay_ms = num(name, optarg, 0, 10000); break;
        case O_DIR + 1: case O_DIR + 6: c->rate_mbit = num(name, optarg, 0, 1e6); break;
        case O_DIR + 2: case O_DIR + 7: c->loss = num(name, optarg, 0, 1); break;
        case O_DIR + 3: case O_DIR + 8: c->qbytes = (uint64_t)num(name, optarg, 0, 1e12); break;
        case O_DIR + 4: case O_DIR + 9: c->qpkts = (uint64_t)num(name, optarg, 0, 1e9); break;
        default: usage();
        }
    }
    if (!ns_a || !ns_b || optind != argc)
        usage();
    if (!dev_b)
        dev_b = dev;
    if (strlen(dev) >= IFNAMSIZ || strlen(dev_b) >= IFNAMSIZ)
        die("--dev/--dev-b: name too long");

    fa = open_tun(ns_a, dev);
    fb = open_tun(ns_b, dev_b);
    init_dir(&ab, "a->b", fa, fb, cab, seed * 2 + 1, ring_mb);
    init_dir(&ba, "b->a", fb, fa, cba, seed * 2 + 2, ring_mb);

    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGHUP);
    sigaddset(&set, SIGUSR1);
    pthread_sigmask(SIG_BLOCK, &set, NULL);          /* inherited: only main waits for them */
    if (pthread_create(&t1, NULL, worker, &ab) || pthread_create(&t2, NULL, worker, &ba))
        die("pthread_create failed");
    printf("READY\n");
    fflush(stdout);
    for (;;) {
        struct timespec tick = {0, 200000000};
        sig = sigtimedwait(&set, NULL, &tick);
        if (sig == SIGUSR1) {
            write_stats(&ab, &ba);
        } else if (sig > 0) {
            write_stats(&ab, &ba);
            _exit(0);
        } else if (parent && getppid() != parent) {  /* orphaned: tear down the devices */
            write_stats(&ab, &ba);
            _exit(1);
        }
    }
}
