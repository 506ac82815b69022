/* delayline: a constant one-way delay between two tun devices (see benchmarks/wan/link.py).
 *
 *   delayline --in wanin --out wanout --delay-us 25000 [--max-bytes 67108864] [--no-offload]
 *             [--rt-priority 10]
 *
 * Creates the tun devices --in and --out (layer 3, in the network namespace it runs in), prints
 * "ready" on stdout, then writes every packet the kernel routes into --in to --out, where the
 * kernel receives it as if it came in on that device, --delay-us microseconds after it was read
 * (CLOCK_MONOTONIC). One constant delay for every packet: a FIFO is the whole schedule, and
 * packets leave in the order they came.
 *
 * Offload (the default): both devices carry a virtio_net_hdr before each packet (IFF_VNET_HDR)
 * and --in accepts TCP segmentation offload, so a TCP sender's 64 KiB GSO packets cross the line
 * whole, header and partial checksum untouched, instead of as 45 packets of 1500 bytes. The
 * header is copied through as it came: the line never looks inside a packet.
 *
 * Timing: with --rt-priority N the line runs SCHED_FIFO at priority N, so that a busy host does
 * not hold a due packet back (a wire does not wait for a CPU); it sleeps in ppoll between
 * packets, so it takes only the CPU its packets need. The counters say how late packets left.
 *
 * Memory: packets waiting for their time hold at most --max-bytes (default 64 MiB); a packet
 * that does not fit is dropped and counted, as a router's full queue would.
 *
 * Exits on SIGTERM, SIGINT or SIGHUP, and when its parent dies (PR_SET_PDEATHSIG), printing one
 * JSON line of counters on stdout; packets still waiting are discarded.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

/* more than the largest frame a tun read returns (a 64 KiB GSO packet, its virtio_net_hdr) */
#define MAX_FRAME (256 << 10)
/* reads per wake-up before due packets are written again (keeps the delay exact under load) */
#define READ_BATCH 64

struct packet {
    struct packet *next;
    uint64_t due_ns;
    size_t len;
    unsigned char data[];
};

static volatile sig_atomic_t stop;

static void on_signal(int sig) {
    (void)sig;
    stop = 1;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "delayline: %s: %s\n", what, strerror(errno));
    exit(1);
}

/* A new non-blocking tun device `name`, owned by this process (gone when it exits). */
static int open_tun(const char *name, int offload) {
    struct ifreq ifr;
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        die("open /dev/net/tun");
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TUN | IFF_NO_PI | (offload ? IFF_VNET_HDR : 0);
    strncpy(ifr.ifr_name, name, IFNAMSIZ - 1);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0)
        die(name);
    /* what the kernel may hand us: checksum-partial and TSO packets (writes accept any) */
    if (offload && ioctl(fd, TUNSETOFFLOAD,
                         TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN) < 0)
        die("TUNSETOFFLOAD");
    return fd;
}

int main(int argc, char **argv) {
    const char *in_name = NULL, *out_name = NULL;
    uint64_t delay_ns = 0, max_bytes = 64u << 20;
    int offload = 1, rt_priority = 0;
    static const struct option opts[] = {
        {"in", required_argument, 0, 'i'},     {"out", required_argument, 0, 'o'},
        {"delay-us", required_argument, 0, 'd'}, {"max-bytes", required_argument, 0, 'm'},
        {"no-offload", no_argument, 0, 'n'},   {"rt-priority", required_argument, 0, 'r'},
        {0, 0, 0, 0}};
    for (int c; (c = getopt_long(argc, argv, "", opts, NULL)) != -1;) {
        switch (c) {
        case 'i': in_name = optarg; break;
        case 'o': out_name = optarg; break;
        case 'd': delay_ns = strtoull(optarg, NULL, 10) * 1000u; break;
        case 'm': max_bytes = strtoull(optarg, NULL, 10); break;
        case 'n': offload = 0; break;
        case 'r': rt_priority = atoi(optarg); break;
        default: return 2;
        }
    }
    if (!in_name || !out_name || optind != argc) {
        fprintf(stderr, "usage: delayline --in TUN --out TUN --delay-us N [--max-bytes N] "
                        "[--no-offload] [--rt-priority N]\n");
        return 2;
    }

    /* the signals stay blocked except inside ppoll: a stop request cannot slip in between the
     * check of `stop` and the wait */
    sigset_t block, waitmask;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigaddset(&block, SIGHUP);
    sigprocmask(SIG_BLOCK, &block, &waitmask);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() == 1) /* the parent died before the line above */
        return 1;
    prctl(PR_SET_TIMERSLACK, 1UL); /* wake up within a microsecond, not the default 50 */
    if (rt_priority > 0) {
        struct sched_param sp = {.sched_priority = rt_priority};
        if (sched_setscheduler(0, SCHED_FIFO, &sp) < 0) { /* reported as rt_priority 0 */
            fprintf(stderr, "delayline: SCHED_FIFO: %s\n", strerror(errno));
            rt_priority = 0;
        }
    }

    int in = open_tun(in_name, offload), out = open_tun(out_name, offload);
    printf("ready\n");
    fflush(stdout);

    static unsigned char frame[MAX_FRAME];
    struct packet *head = NULL, *tail = NULL;
    uint64_t queued = 0, queued_pkts = 0, max_queued = 0, max_queued_pkts = 0;
    uint64_t rx_pkts = 0, rx_bytes = 0, tx_pkts = 0, tx_bytes = 0;
    uint64_t drop_pkts = 0, drop_bytes = 0, tx_errors = 0;
    uint64_t late_sum_ns = 0, late_max_ns = 0; /* how long after its due time a packet left */
    struct pollfd pfd = {.fd = in, .events = POLLIN};

    while (!stop) {
        /* send whatever is due (a write runs the kernel's forwarding: the clock is read anew) */
        uint64_t now = now_ns();
        while (head && head->due_ns <= now) {
            struct packet *p = head;
            uint64_t late = now - p->due_ns;
            late_sum_ns += late;
            if (late > late_max_ns)
                late_max_ns = late;
            if (write(out, p->data, p->len) == (ssize_t)p->len) {
                tx_pkts++;
                tx_bytes += p->len;
            } else {
                tx_errors++; /* the kernel refused it (no buffer): lost, like on a wire */
            }
            head = p->next;
            if (!head)
                tail = NULL;
            queued -= p->len;
            queued_pkts--;
            free(p);
            now = now_ns();
        }
        /* sleep until a packet comes in or the oldest one is due */
        struct timespec timeout, *tp = NULL;
        if (head) {
            uint64_t wait = head->due_ns - now;
            timeout.tv_sec = (time_t)(wait / 1000000000u);
            timeout.tv_nsec = (long)(wait % 1000000000u);
            tp = &timeout;
        }
        int ready = ppoll(&pfd, 1, tp, &waitmask);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            die("ppoll");
        }
        if (ready == 0 || !(pfd.revents & POLLIN))
            continue;
        for (int i = 0; i < READ_BATCH; i++) {
            ssize_t n = read(in, frame, sizeof frame);
            if (n < 0) {
                if (errno == EAGAIN || errno == EINTR)
                    break;
                die("read");
            }
            rx_pkts++;
            rx_bytes += (uint64_t)n;
            if (queued + (uint64_t)n > max_bytes) {
                drop_pkts++;
                drop_bytes += (uint64_t)n;
                continue;
            }
            struct packet *p = malloc(sizeof *p + (size_t)n);
            if (!p)
                die("malloc");
            p->next = NULL;
            p->due_ns = now_ns() + delay_ns;
            p->len = (size_t)n;
            memcpy(p->data, frame, (size_t)n);
            if (tail)
                tail->next = p;
            else
                head = p;
            tail = p;
            queued += (uint64_t)n;
            if (queued > max_queued)
                max_queued = queued;
            if (++queued_pkts > max_queued_pkts)
                max_queued_pkts = queued_pkts;
        }
    }

    /* bytes include the virtio_net_hdr of each packet when offload is on */
    printf("{\"rx_packets\": %llu, \"rx_bytes\": %llu, \"tx_packets\": %llu, \"tx_bytes\": %llu, "
           "\"dropped_packets\": %llu, \"dropped_bytes\": %llu, \"tx_errors\": %llu, "
           "\"left_packets\": %llu, \"max_queued_bytes\": %llu, \"max_queued_packets\": %llu, "
           "\"late_mean_us\": %.1f, \"late_max_us\": %.1f, \"delay_us\": %llu, "
           "\"offload\": %s, \"rt_priority\": %d}\n",
           (unsigned long long)rx_pkts, (unsigned long long)rx_bytes,
           (unsigned long long)tx_pkts, (unsigned long long)tx_bytes,
           (unsigned long long)drop_pkts, (unsigned long long)drop_bytes,
           (unsigned long long)tx_errors, (unsigned long long)queued_pkts,
           (unsigned long long)max_queued, (unsigned long long)max_queued_pkts,
           tx_pkts + tx_errors ? late_sum_ns / 1e3 / (double)(tx_pkts + tx_errors) : 0.0,
           late_max_ns / 1e3,
           (unsigned long long)(delay_ns / 1000u), offload ? "true" : "false", rt_priority);
    fflush(stdout);
    while (head) {
        struct packet *p = head;
        head = p->next;
        free(p);
    }
    close(in);
    close(out);
    return 0;
}
