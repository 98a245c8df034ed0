// SPDX-License-Identifier: Apache-2.0
/*
 * adaptermesh shard classifier: a TC (clsact, direct-action) program that picks an adapter
 * shard for every IPv4/IPv6 packet from its source address, steers it there, counts it, and
 * reports each new flow through a ring buffer.
 *
 * Decision order: pinned CIDR (longest prefix) -> the flow's sticky shard -> weighted Maglev
 * table indexed by a hash of the source address. A chosen shard must be ACTIVE; a pin or a
 * sticky entry naming a shard that is not falls through to the next step, so nothing new is
 * ever sent to a draining shard. Before all of that, a TCP connection the classifier has seen
 * stays on the shard of its first packet while that shard is ACTIVE or DRAINING (am_conns): a
 * pin, a weight change or a drain moves the source's new connections, never one in flight,
 * whose packets would reach an Envoy that never saw it and be reset. A SYN without ACK opens
 * the connection again (a reused port) and takes the decision above. Frames that cannot be
 * classified safely (truncated or invalid headers, VLAN tags, non-IP) and sources no client
 * has (link-local, unspecified, loopback, multicast, broadcast) pass untouched and are counted
 * in am_counters.
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/in.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>
#include <uapi/linux/pkt_cls.h>

#include "classifier.h"

/* With AM_PIN_DIR every map is pinned at AM_PIN_DIR/<name>; an existing pin is reused. */
#ifdef AM_PIN_DIR
#define AM_SECTION(type, name) type ":" AM_PIN_DIR "/" #name
#else
#define AM_SECTION(type, name) type
#endif
#define AM_TABLE(type, k, v, name, n, flags) BPF_F_TABLE(AM_SECTION(type, name), k, v, name, n, flags)

/* The same shape as bcc's BPF_RINGBUF_OUTPUT, plus the pin path in the section name. */
#define AM_RINGBUF(_name, _num_pages)                                   \
	struct _name##_table_t {                                        \
		int key;                                                \
		u32 leaf;                                               \
		int (*ringbuf_output)(void *, u64, u64);                \
		void *(*ringbuf_reserve)(u64);                          \
		void (*ringbuf_discard)(void *, u64);                   \
		void (*ringbuf_submit)(void *, u64);                    \
		u32 max_entries;                                        \
	};                                                              \
	__attribute__((section("maps/" AM_SECTION("ringbuf", _name)))) \
	struct _name##_table_t _name = { .max_entries = ((_num_pages) * PAGE_SIZE) }

struct am_addr {
	__u8 a[16];
};

/* am_pins: LPM trie, CIDR (IPv4-mapped for IPv4) -> shard index. Agent writes; classifier reads. */
AM_TABLE("lpm_trie", struct am_lpm_key, __u32, am_pins, AM_MAX_PINS, BPF_F_NO_PREALLOC);
/* am_flows: LRU hash, source address -> struct am_flow. Classifier writes and reads. */
AM_TABLE("lru_hash", struct am_addr, struct am_flow, am_flows, AM_MAX_FLOWS, 0);
/* am_conns: LRU hash, TCP connection -> struct am_conn. Classifier writes and reads. */
AM_TABLE("lru_hash", struct am_conn_key, struct am_conn, am_conns, AM_MAX_CONNS, 0);
/* am_maglev: array[2] of struct am_maglev_table. Agent fills the idle one; classifier reads. */
AM_TABLE("array", __u32, struct am_maglev_table, am_maglev, 2, 0);
/* am_ctl: array[1] of struct am_ctl. Agent flips it after filling the idle table. */
AM_TABLE("array", __u32, struct am_ctl, am_ctl, 1, 0);
/* am_shards: array, shard index -> struct am_shard. Agent writes; classifier reads. */
AM_TABLE("array", __u32, struct am_shard, am_shards, AM_MAX_SHARDS, 0);
/* am_stats: per-CPU array, shard index -> struct am_stats. Classifier writes; agent sums. */
AM_TABLE("percpu_array", __u32, struct am_stats, am_stats, AM_MAX_SHARDS, 0);
/* am_counters: per-CPU array, AM_CNT_* -> u64. Classifier writes; agent sums and exports. */
AM_TABLE("percpu_array", __u32, __u64, am_counters, AM_CNT_MAX, 0);
/* am_events: ring buffer of struct am_event, one per new flow. Classifier writes; agent polls. */
AM_RINGBUF(am_events, AM_RINGBUF_PAGES);

static __always_inline void am_count(__u32 idx)
{
	__u64 *c = am_counters.lookup(&idx);
	if (c)
		*c += 1;
}

/*
 * The L3 header, len bytes at ETH_HLEN: in place when the linear part holds it (every small
 * packet), else copied into buf. GRO/GSO super-frames and jumbo frames can arrive with little
 * more than the Ethernet header linear; read in place they would look truncated. Copying every
 * header instead would cost a helper call per packet, so the copy is only the fallback.
 * NULL: the frame is shorter than the header.
 */
static __always_inline void *am_l3(struct __sk_buff *skb, void *buf, __u32 len)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;

	if (data + ETH_HLEN + len <= data_end)
		return data + ETH_HLEN;
	if (bpf_skb_load_bytes(skb, ETH_HLEN, buf, len) < 0)
		return NULL;
	return buf;
}

/*
 * IPv4 sources that no client has: the kernel's own martian-source set (0.0.0.0/8, 127.0.0.0/8,
 * 224.0.0.0/4, 255.255.255.255). IPv4 is keyed IPv4-mapped, so these would otherwise hash and
 * match pins like real tenants.
 */
static __always_inline int am_martian4(__be32 saddr)
{
	__u8 b0 = ((__u8 *)&saddr)[0];
	return b0 == 0 || b0 == 127 || (b0 & 0xf0) == 0xe0 || saddr == 0xffffffff;
}

/*
 * IPv6 sources that no client has: multicast (ff00::/8), unspecified (::, duplicate address
 * detection), loopback (::1) and IPv4-mapped (::ffff:0:0/96: never valid on the wire, and it
 * is the key space of IPv4 sources, so it would let an IPv6 packet take an IPv4 tenant's pin
 * and sticky shard).
 */
static __always_inline int am_martian6(const struct am_addr *src)
{
	__u32 w[4];
	__builtin_memcpy(w, src->a, 16);
	if (src->a[0] == 0xff)
		return 1;
	if (w[0] | w[1])
		return 0;
	return w[2] == bpf_htonl(0xffff) || (w[2] == 0 && (w[3] == 0 || w[3] == bpf_htonl(1)));
}

static __always_inline __u32 am_fmix(__u32 h)
{
	h ^= h >> 16;
	h *= 0x85ebca6b;
	h ^= h >> 13;
	h *= 0xc2b2ae35;
	h ^= h >> 16;
	return h;
}

/* Must stay in sync with maglev.source_hash(): four little-endian words of the address. */
static __always_inline __u32 am_hash(const struct am_addr *addr)
{
	__u32 w[4];
	__builtin_memcpy(w, addr->a, 16);
	__u32 h = 0x9747b28c;
	h = am_fmix(h ^ w[0]);
	h = am_fmix(h ^ w[1]);
	h = am_fmix(h ^ w[2]);
	h = am_fmix(h ^ w[3]);
	return h;
}

static __always_inline struct am_shard *am_active_shard(__u32 idx)
{
	struct am_shard *sh = am_shards.lookup(&idx);
	if (sh && sh->state == AM_STATE_ACTIVE)
		return sh;
	return NULL;
}

static __always_inline __u32 am_maglev_pick(const struct am_addr *addr, struct am_ctl *ctl)
{
	__u32 table = ctl->active & 1;
	struct am_maglev_table *t = am_maglev.lookup(&table);
	if (!t)
		return AM_NO_SHARD;
	__u32 slot = am_hash(addr) % AM_MAGLEV_SIZE;
	/* Hide the modulo's range from clang so the bounds check below reaches the verifier. */
	asm volatile("" : "+r"(slot));
	if (slot >= AM_MAGLEV_SIZE)
		return AM_NO_SHARD;
	return t->slot[slot];
}

static __always_inline void am_emit(const struct am_addr *addr, __u32 shard, __u32 reason,
				    __u64 now, __u64 version, struct am_stats *st)
{
	struct am_event *e = am_events.ringbuf_reserve(sizeof(struct am_event));
	if (!e) {
		/* The consumer fell behind: count it so a loss is never silent. */
		am_count(AM_CNT_RB_FAILED);
		st->events_dropped += 1;
		return;
	}
	e->ts_ns = now;
	__builtin_memcpy(e->src, addr->a, 16);
	e->shard = shard;
	e->reason = reason;
	e->version = version;
	am_events.ringbuf_submit(e, 0);
}

#define AM_TCP_SYN 0x02
#define AM_TCP_ACK 0x10

/*
 * The TCP header's ports (into key) and flags at offset off; 0 when the frame does not hold
 * them (the packet then classifies by its source alone, as UDP does).
 */
static __always_inline int am_tcp(struct __sk_buff *skb, __u32 off, struct am_conn_key *key,
				  __u8 *flags)
{
	__u8 th[14];
	if (bpf_skb_load_bytes(skb, off, th, sizeof(th)) < 0)
		return 0;
	__builtin_memcpy(&key->sport, &th[0], 2);
	__builtin_memcpy(&key->dport, &th[2], 2);
	*flags = th[13];
	return 1;
}

static __always_inline int am_steer(struct __sk_buff *skb, struct am_shard *sh)
{
	if (sh->kind == AM_STEER_MARK) {
		skb->mark = sh->mark;
		return TC_ACT_OK;
	}
	if (sh->kind != AM_STEER_TUNNEL && sh->kind != AM_STEER_REDIRECT)
		return TC_ACT_OK;
	__u32 ifindex = sh->ifindex;
	__u64 redirect_flags = (sh->flags & AM_F_INGRESS) ? BPF_F_INGRESS : 0;
	if (sh->kind == AM_STEER_TUNNEL) {
		struct bpf_tunnel_key tk = {};
		tk.remote_ipv4 = sh->remote_ipv4;
		tk.tunnel_id = sh->vni;
		tk.tunnel_ttl = 64;
		if (bpf_skb_set_tunnel_key(skb, &tk, sizeof(tk), 0) < 0)
			goto fail;
		redirect_flags = 0;
	}
	if (sh->flags & AM_F_SET_MAC) {
		__u8 mac[6];
		__builtin_memcpy(mac, sh->mac, 6);
		if (bpf_skb_store_bytes(skb, 0, mac, 6, 0) < 0)
			goto fail;
	}
	return bpf_redirect(ifindex, redirect_flags);
fail:
	am_count(AM_CNT_STEER_FAIL);
	return TC_ACT_OK;
}

int am_classify(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	struct ethhdr *eth = data;
	struct am_addr src = {};
	struct am_lpm_key pkey = {};
	struct am_conn_key ckey = {};
	int tcp = 0;
	__u8 tflags = 0;

	if (skb->vlan_present) {
		/* Tagged frames belong to another L2 domain: never steer them. */
		am_count(AM_CNT_VLAN);
		return TC_ACT_OK;
	}
	if ((void *)(eth + 1) > data_end) {
		am_count(AM_CNT_MALFORMED);
		return TC_ACT_OK;
	}
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr buf4;
		struct iphdr *ip = am_l3(skb, &buf4, sizeof(buf4));
		/* Options may lie beyond the linear part: the whole frame (skb->len) must hold them. */
		if (!ip || ip->version != 4 || ip->ihl < 5 || bpf_ntohs(ip->tot_len) < ip->ihl * 4 ||
		    ETH_HLEN + ip->ihl * 4 > skb->len) {
			am_count(AM_CNT_MALFORMED);
			return TC_ACT_OK;
		}
		__be32 saddr = ip->saddr;
		/* Link-local sources (169.254.0.0/16) talk to this node only (RFC 3927). */
		if ((saddr & bpf_htonl(0xffff0000)) == bpf_htonl(0xa9fe0000)) {
			am_count(AM_CNT_LINK_LOCAL);
			return TC_ACT_OK;
		}
		if (am_martian4(saddr)) {
			am_count(AM_CNT_MARTIAN);
			return TC_ACT_OK;
		}
		/* Only the source address matters, so options and fragments classify alike. */
		src.a[10] = 0xff;
		src.a[11] = 0xff;
		__builtin_memcpy(&src.a[12], &saddr, 4);
		/* A TCP segment's connection (first fragments and whole packets: later fragments
		 * carry no ports and classify by source). */
		if (AM_LEARN && ip->protocol == IPPROTO_TCP &&
		    !(ip->frag_off & bpf_htons(0x1fff))) {
			__be32 daddr = ip->daddr;
			ckey.src[10] = 0xff;
			ckey.src[11] = 0xff;
			__builtin_memcpy(&ckey.src[12], &saddr, 4);
			ckey.dst[10] = 0xff;
			ckey.dst[11] = 0xff;
			__builtin_memcpy(&ckey.dst[12], &daddr, 4);
			tcp = am_tcp(skb, ETH_HLEN + ip->ihl * 4, &ckey, &tflags);
		}
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr buf6;
		struct ipv6hdr *ip6 = am_l3(skb, &buf6, sizeof(buf6));
		if (!ip6 || ip6->version != 6) {
			am_count(AM_CNT_MALFORMED);
			return TC_ACT_OK;
		}
		/* Link-local sources (fe80::/10: neighbour discovery) talk to this node only. */
		if (ip6->saddr.in6_u.u6_addr8[0] == 0xfe &&
		    (ip6->saddr.in6_u.u6_addr8[1] & 0xc0) == 0x80) {
			am_count(AM_CNT_LINK_LOCAL);
			return TC_ACT_OK;
		}
		__builtin_memcpy(src.a, &ip6->saddr, 16);
		if (am_martian6(&src)) {
			am_count(AM_CNT_MARTIAN);
			return TC_ACT_OK;
		}
		/* TCP right after the fixed header (behind extension headers: by source alone). */
		if (AM_LEARN && ip6->nexthdr == IPPROTO_TCP) {
			__builtin_memcpy(ckey.src, &ip6->saddr, 16);
			__builtin_memcpy(ckey.dst, &ip6->daddr, 16);
			tcp = am_tcp(skb, ETH_HLEN + sizeof(struct ipv6hdr), &ckey, &tflags);
		}
	} else if (eth->h_proto == bpf_htons(ETH_P_8021Q) ||
		   eth->h_proto == bpf_htons(ETH_P_8021AD)) {
		am_count(AM_CNT_VLAN);
		return TC_ACT_OK;
	} else {
		am_count(AM_CNT_NON_IP);
		return TC_ACT_OK;
	}

#if AM_LEARN
	/* Only flow learning needs the time: the stateless build skips the helper call. */
	__u64 now = bpf_ktime_get_ns();
#endif
	__u32 len = skb->len;
	__u32 shard = AM_NO_SHARD;
	__u32 reason = 0;
	struct am_shard *sh = NULL;
	struct am_flow *flow = NULL;

#if AM_LEARN
	/* An opening SYN (no ACK) takes a fresh decision; any other segment of a connection the
	 * classifier has seen goes where the connection went, unless that shard is gone. */
	int opening = (tflags & (AM_TCP_SYN | AM_TCP_ACK)) == AM_TCP_SYN;
	if (tcp && !opening) {
		struct am_conn *conn = am_conns.lookup(&ckey);
		if (conn) {
			__u32 cshard = conn->shard;
			struct am_shard *csh = am_shards.lookup(&cshard);
			struct am_stats *cst = am_stats.lookup(&cshard);
			if (csh && cst &&
			    (csh->state == AM_STATE_ACTIVE || csh->state == AM_STATE_DRAINING)) {
				/* No refresh: the LRU's own lookup keeps the entry recent. */
				cst->packets += 1;
				cst->bytes += len;
				return am_steer(skb, csh);
			}
		}
	}
	flow = am_flows.lookup(&src);
#endif
	pkey.prefixlen = 128;
	__builtin_memcpy(pkey.addr, src.a, 16);
	__u32 *pin = am_pins.lookup(&pkey);
	if (pin) {
		shard = *pin;
		sh = am_active_shard(shard);
		if (sh && (!flow || flow->shard != shard))
			reason = AM_REASON_PIN;
	}
	if (!sh && flow) {
		shard = flow->shard;
		sh = am_active_shard(shard);
		if (!sh)
			reason = AM_REASON_REPICK;
	}
	__u64 version = 0;
	if (!sh) {
		__u32 zero = 0;
		struct am_ctl *ctl = am_ctl.lookup(&zero);
		if (!ctl) {
			am_count(AM_CNT_NO_SHARD);
			return TC_ACT_OK;
		}
		version = ctl->version;
		shard = am_maglev_pick(&src, ctl);
		sh = am_active_shard(shard);
		if (!sh) {
			am_count(AM_CNT_NO_SHARD);
			return TC_ACT_OK;
		}
		if (!reason)
			reason = AM_REASON_MAGLEV;
	}

	struct am_stats *st = am_stats.lookup(&shard);
	if (!st) {
		am_count(AM_CNT_NO_SHARD);
		return TC_ACT_OK;
	}
	st->packets += 1;
	st->bytes += len;
#if AM_LEARN
	if (reason) {
		if (!version) {
			__u32 zero = 0;
			struct am_ctl *ctl = am_ctl.lookup(&zero);
			if (ctl)
				version = ctl->version;
		}
		struct am_flow nf = { .last_seen_ns = now, .shard = shard, .reason = reason };
		am_flows.update(&src, &nf);
		st->new_flows += 1;
		am_emit(&src, shard, reason, now, version, st);
	} else if (flow && now - flow->last_seen_ns > 1000000000ULL) {
		/* Refresh at most once a second: a write per packet would bounce the cache line. */
		flow->last_seen_ns = now;
	}
	if (tcp) {
		/* The connection's first packet seen here (its SYN, or a segment of one that began
		 * before the classifier knew it), or a SYN reopening it: it stays on this shard.
		 * Entries outlive FIN and RST (the last ACKs still need them); the LRU drops the
		 * least recently used, and a connection whose entry it dropped classifies by source
		 * again. */
		struct am_conn nc = { .shard = shard };
		am_conns.update(&ckey, &nc);
	}
#endif
	return am_steer(skb, sh);
}
