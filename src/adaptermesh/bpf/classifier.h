/* SPDX-License-Identifier: Apache-2.0 */
/*
 * Structs and constants shared by classifier.bpf.c and user space (loader.py).
 * Every Python mirror names the struct it must stay in sync with, and
 * tests/bpf/test_layout.py checks that the sizes agree.
 */
#ifndef AM_CLASSIFIER_H
#define AM_CLASSIFIER_H

/* Build knobs: the loader passes these as -D cflags; the defaults keep the file valid C. */
#ifndef AM_MAGLEV_SIZE
#define AM_MAGLEV_SIZE 65537 /* M: prime, entries per Maglev table */
#endif
#ifndef AM_MAX_SHARDS
#define AM_MAX_SHARDS 256 /* shard indices are 0 .. AM_MAX_SHARDS - 1 */
#endif
#ifndef AM_MAX_PINS
#define AM_MAX_PINS 16384
#endif
#ifndef AM_MAX_FLOWS
#define AM_MAX_FLOWS 262144
#endif
#ifndef AM_MAX_CONNS
#define AM_MAX_CONNS 262144
#endif
#ifndef AM_RINGBUF_PAGES
#define AM_RINGBUF_PAGES 256 /* 1 MiB: about 21,000 events of headroom */
#endif
#ifndef AM_LEARN
#define AM_LEARN 1 /* 0 builds a stateless variant (no am_flows writes, no events) */
#endif

/* A Maglev slot holding this value has no shard (no active shard had weight). */
#define AM_NO_SHARD 0xffff

/* struct am_shard.state */
#define AM_STATE_ABSENT 0
#define AM_STATE_ACTIVE 1
#define AM_STATE_DRAINING 2

/* struct am_shard.kind */
#define AM_STEER_NONE 0     /* count only, pass the packet on */
#define AM_STEER_TUNNEL 1   /* VXLAN tunnel key + redirect to the collect-metadata device */
#define AM_STEER_REDIRECT 2 /* redirect to a local interface */
#define AM_STEER_MARK 3     /* set skb->mark for policy routing */

/* struct am_shard.flags */
#define AM_F_SET_MAC 0x1 /* write mac[] as the (inner) destination MAC first */
#define AM_F_INGRESS 0x2 /* redirect into the interface's ingress path */

/* struct am_event.reason */
#define AM_REASON_PIN 1    /* a pinned CIDR chose the shard */
#define AM_REASON_MAGLEV 2 /* a new flow took the Maglev table's shard */
#define AM_REASON_REPICK 3 /* a sticky flow's shard left ACTIVE; the table re-picked */

/* Indices into am_counters (per-CPU u64), read by loader.read_counters(). */
#define AM_CNT_RB_FAILED 0 /* ring-buffer reservations that failed: lost events */
#define AM_CNT_NON_IP 1    /* neither IPv4 nor IPv6: passed untouched */
#define AM_CNT_MALFORMED 2 /* truncated or invalid Ethernet/IP header: passed untouched */
#define AM_CNT_VLAN 3      /* VLAN-tagged in the packet data: passed untouched */
#define AM_CNT_NO_SHARD 4  /* no active shard to pick: passed untouched */
#define AM_CNT_STEER_FAIL 5 /* a steering helper failed: passed untouched */
#define AM_CNT_LINK_LOCAL 6 /* link-local source (fe80::/10, 169.254.0.0/16): passed untouched */
#define AM_CNT_MARTIAN 7    /* a source no client has (unspecified, loopback, multicast,
			     * 255.255.255.255, IPv4-mapped in an IPv6 header): passed untouched */
#define AM_CNT_MAX 8 /* the pinned am_counters has 8 entries: a ninth needs a new map */

/* am_pins key: IPv4 lives in the IPv4-mapped IPv6 space (::ffff:a.b.c.d, prefixlen 96 + n). */
struct am_lpm_key {
	__u32 prefixlen;
	__u8 addr[16];
};

/* am_flows key is the 16-byte source address; this is its value. */
struct am_flow {
	__u64 last_seen_ns;
	__u32 shard;
	__u32 reason;
};

/* am_conns key: one TCP connection from a client (source and destination, IPv4-mapped for
 * IPv4, and ports in network byte order). */
struct am_conn_key {
	__u8 src[16];
	__u8 dst[16];
	__u16 sport;
	__u16 dport;
	__u32 pad;
};

/* am_conns value: the shard the connection's first packet went to (the LRU decides which
 * entries go). */
struct am_conn {
	__u32 shard;
	__u32 pad;
};

/* am_shards value: how to steer a packet to one shard. */
struct am_shard {
	__u8 state;
	__u8 kind;
	__u8 flags;
	__u8 pad0;
	__u32 ifindex;     /* redirect target, or the VXLAN device for tunnel */
	__u32 remote_ipv4; /* tunnel: host byte order */
	__u32 vni;         /* tunnel */
	__u32 mark;        /* mark */
	__u8 mac[6];       /* AM_F_SET_MAC */
	__u8 pad1[2];
};

/* am_maglev value: one table. am_maglev holds two of them (key 0 and 1). */
struct am_maglev_table {
	__u16 slot[AM_MAGLEV_SIZE];
};

/* am_ctl value (one entry): which am_maglev table is live, and the assignment version. */
struct am_ctl {
	__u32 active;
	__u32 pad;
	__u64 version;
};

/* am_stats value (per CPU, per shard index). */
struct am_stats {
	__u64 packets;
	__u64 bytes;
	__u64 new_flows;
	__u64 events_dropped;
};

/* am_events record. */
struct am_event {
	__u64 ts_ns;
	__u8 src[16];
	__u32 shard;
	__u32 reason;
	__u64 version;
};

#endif /* AM_CLASSIFIER_H */
