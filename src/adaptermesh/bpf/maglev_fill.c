// SPDX-License-Identifier: Apache-2.0
/*
 * The weighted Maglev fill loop of maglev.build_table_py(), in C: the same rounds, the same
 * turn rule and the same probing, so both produce identical tables (tests/bpf/test_maglev.py
 * checks it). Callers pass backends sorted by key, each with weight > 0.
 */
#include <stdint.h>

#define AM_NO_SHARD 0xffff

int am_maglev_fill(uint32_t size, uint32_t n, const uint64_t *offset, const uint64_t *skip,
		   const uint64_t *weight, const uint16_t *value, uint64_t *next, uint16_t *table)
{
	uint64_t w_max = 0, filled = 0, r = 0;
	uint32_t i;

	if (n == 0 || size == 0)
		return -1;
	for (i = 0; i < n; i++) {
		if (weight[i] == 0)
			return -2;
		if (weight[i] > w_max)
			w_max = weight[i];
		next[i] = 0;
	}
	for (uint32_t s = 0; s < size; s++)
		table[s] = AM_NO_SHARD;
	for (;;) {
		r++;
		for (i = 0; i < n; i++) {
			if ((r * weight[i]) / w_max == ((r - 1) * weight[i]) / w_max)
				continue;
			uint64_t j = next[i];
			uint64_t c = (offset[i] + j * skip[i]) % size;
			while (table[c] != AM_NO_SHARD) {
				j++;
				c = (offset[i] + j * skip[i]) % size;
			}
			table[c] = value[i];
			next[i] = j + 1;
			if (++filled == size)
				return 0;
		}
	}
}
