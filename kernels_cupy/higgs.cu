// Decode attention over a HIGGS store (kvquant.formats.higgs) whose keys were coded after RoPE (method
// higgs_post_rope: higgs_r*) or before it (method higgs: higgs_pre_r*), read as stored: codes looked up in
// the grid in registers, never written out. The torch reference is kvquant.formats.higgs.attend;
// kernels_cupy/higgs_emulate.py is this file line for line in torch.
//
// Layout (kvquant.quant.higgs; contiguous tensors): a token's codes cover the whole row of Hkv*D
// channels, cut into G groups of `group` channels (HPG = group / D whole KV heads), each zero-padded to
// P coordinates; codes [B, nc, row_bytes] (cb = 4, 6 or 8 bits a code, kvquant.quant.bitpack: low bits
// first, 6-bit codes in 3-byte words of 4), one code per 2 coordinates, group gi's codes from code
// gi*P/2; scales fp16 [B, nc, G]. Dequantized, group gi of token t is
//   g = s_t * signs * (y_t H^T) / sqrt(P),  H = kron(outer [m, m], S_p),  y_t = grid[codes].
// The fp16 sinks [B, Hkv, ns, D] come first, the codes next, the fp16 recent window [B, Hkv, nr, D] last.
//
// Query rows come as q [B, G, RM, D] fp32 (RM = HPG*g*Q rows a group, zero rows past a short last group).
// Scores in the rotated domain: q . g = s_t * (qt . y_t) with qt = ((signs * q) H) / sqrt(P), each
// query row placed at its head's channels of the group and rotated once per step (higgs.py, in torch).
// Values summed in the rotated domain: sum_t p_t g_t = signs * ((sum_t p_t s_t y_t) H^T) / sqrt(P), the
// inverse rotation taken once per query row in higgs_merge, never per token.
// Keys coded before RoPE (PRE, rope_kind 1 or 2) cannot be scored in the rotated domain (RoPE differs per
// token), so each token's key is rebuilt in the code splits (rebuild_key): grid points, the S_p transform
// (butterflies in a lane, by shuffle across the token's lanes, through shared memory for strides >= 256),
// the outer factor's mix, signs / sqrt(P), then RoPE at the token's position (cos/sin of float(position) *
// inv_freq times rope_scale, or the layer's cos/sin tables), and scored against the plain query rows as the
// fp16 parts are: q . k = s_t * (q . k'_t). Nothing but one round of coordinates (nseg * P <= 1024 floats,
// two rounds alternating) lives in shared memory; values are summed as above.
//
// Grid (n_split, B*G, row tiles), HIGGS_THREADS threads. Splits never straddle two parts: the first n0
// cover the sinks, the next n1 the codes, the rest the recent window, each part cut into its own chunks.
// A CTA takes RT rows of one group (rows j*Q + i of the group: query head j, position i; the head's
// KV head is j / g). A lane holds 8 coordinates (4 codes) of the group, or in an fp16 part the same 8
// channels of the group's heads; LPT lanes (a power of two >= P/8, up to 128) read one token. With
// LPT <= 32 a warp holds 32/LPT lane groups and a token's dot product is a shuffle reduction; with
// LPT = 64 or 128 a token spans 2 or 4 warps, whose partial sums meet in shared memory (one
// __syncthreads per step, double-buffered). The NSEG = 128/LPT lane groups each run their own online
// softmax over tokens base + u*NSEG + group (u < U), are merged in shared memory at the end, and each
// CTA writes (m, l, acc[P]) per row: acc is the rotated-domain sum in a code split, the plain sum over
// the group's channels in an fp16 split. higgs_merge takes the log-sum-exp of the splits.
//
// No headers (as codes.cu): nvcc (CI, PTX) and NVRTC compile it unchanged.

#define HIGGS_THREADS 128
#define HIGGS_WARPS (HIGGS_THREADS / 32)
#define HIGGS_NEG_INF (__int_as_float(0xff800000))
#define HIGGS_FULL_MASK 0xffffffffu

__device__ __forceinline__ float higgs_h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// The 4 codes k0 .. k0+3 (k0 a multiple of 4, so a lane's codes start on a byte) as grid points: 8 floats.
// cb (4, 6 or 8 bits a code) is the same in every lane: a uniform branch, one kernel for the three widths.
__device__ __forceinline__ void lane_points(const unsigned char* row, int k0, int cb, const float* grid,
                                            float (&y)[8]) {
    unsigned int w;
    if (cb == 4) {
        w = *reinterpret_cast<const unsigned short*>(row + k0 / 2);
    } else if (cb == 8) {
        w = *reinterpret_cast<const unsigned int*>(row + k0);
    } else {
        const unsigned char* p = row + k0 / 4 * 3;
        w = (unsigned int)p[0] | ((unsigned int)p[1] << 8) | ((unsigned int)p[2] << 16);
    }
    const unsigned int mask = (1u << cb) - 1u;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const unsigned int c = (w >> (cb * j)) & mask;
        y[2 * j] = grid[2 * c];
        y[2 * j + 1] = grid[2 * c + 1];
    }
}

// 8 consecutive fp16 values (16-byte aligned) as fp32.
__device__ __forceinline__ void higgs_half8(const unsigned short* p, float (&x)[8]) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const unsigned int u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = higgs_h2f((unsigned short)((u[j >> 1] >> (16 * (j & 1))) & 0xFFFFu));
}

// One stored side (K or V): codes and scales, the fp16 sinks and recent window.
struct HiggsSide {
    const unsigned char* codes;
    const unsigned short *scale, *sink, *recent;
};

// Token t's 8 values at the lane (coordinates cc.. of the group in a code split, channels cc.. of the
// group's heads in an fp16 one), and its scale (1 for fp16 tokens).
__device__ __forceinline__ float load_token(const HiggsSide& s, int seg, int cb, int t, int b, int gi, int cc,
                                            bool active, int ns, int nc, int nr, int row_bytes, int G, int Hkv,
                                            int HPG, int D, int P, const float* grid, float (&x)[8]) {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = 0.0f;
    if (seg == 1) {
        const long long ct = (long long)b * nc + (t - ns);
        if (active) lane_points(s.codes + ct * row_bytes, gi * (P / 2) + cc / 2, cb, grid, x);
        return higgs_h2f(s.scale[ct * G + gi]);
    }
    if (active) {
        const long long kvh = (long long)gi * HPG + cc / D;
        const long long tok = seg == 0 ? (long long)b * Hkv * ns + kvh * ns + t
                                       : (long long)b * Hkv * nr + kvh * nr + (t - ns - nc);
        higgs_half8((seg == 0 ? s.sink : s.recent) + tok * D + cc % D, x);
    }
    return 1.0f;
}

// RoPE of a pre-RoPE key (method higgs): how the layer gives cos/sin at a coded token (HiggsState.rope).
struct HiggsRope {
    int kind;               // 0: keys coded after RoPE (scored in the rotated domain); 1: positions; 2: tables
    const int* positions;   // [B, nc] int32 (kind 1)
    const float* inv_freq;  // [D/2] (kind 1): cos/sin(float(position) * inv_freq) * scale
    float scale;
    const float *cos, *sin;  // [B, nc, D] fp32 (kind 2)
};

// sin and cos of an fp32 angle: the quadrant found in double (exact for any position a model reaches), the
// remainder (|r| <= pi/4) through Cephes' sinf/cosf polynomials, so no slow-path reduction (no stack frame).
// higgs.rope_sincos is this in torch.
__device__ __forceinline__ void higgs_sincos(float a, float& sn, float& cs) {
    const double x = (double)a;
    const double kq = rint(x * 0.63661977236758134308);
    const double rd = fma(-kq, 6.123233995736766036e-17, fma(-kq, 1.5707963267948965580, x));
    const float r = (float)rd, r2 = r * r;
    const float ps = fmaf(r * r2, fmaf(r2, fmaf(r2, -1.9515295891e-4f, 8.3321608736e-3f), -1.6666654611e-1f), r);
    const float pc =
        fmaf(r2 * r2, fmaf(r2, fmaf(r2, 2.443315711809948e-5f, -1.388731625493765e-3f), 4.166664568298827e-2f),
             fmaf(-0.5f, r2, 1.0f));
    const int quadrant = (int)((long long)kq & 3);
    sn = quadrant == 0 ? ps : quadrant == 1 ? pc : quadrant == 2 ? -ps : -pc;
    cs = quadrant == 0 ? pc : quadrant == 1 ? -ps : quadrant == 2 ? -pc : ps;
}

// Coordinate c of a group after the inverse rotation's outer mix: sum_a outer[c / p, a] * z[a * p + c % p]
// (z: the group after the S_p transform), z[c] itself when P is a power of two (m = 1).
__device__ __forceinline__ float higgs_mixed(const float* z, const float* outer, int m, int p, int c) {
    if (m == 1) return z[c];
    const float* o = outer + (c / p) * m;
    const int lo = c % p;
    float x = 0.0f;
    for (int a = 0; a < m; ++a) x = fmaf(o[a], z[a * p + lo], x);
    return x;
}

// cos and sin of RoPE at channel e of a head of D for coded token ct: cos/sin(float(position) * inv_freq[e mod
// D/2]) * scale (kind 1), or the tables (kind 2).
__device__ __forceinline__ void higgs_rope_at(const HiggsRope& rope, long long ct, int e, int D, float& cs, float& sn) {
    if (rope.kind == 1) {
        higgs_sincos((float)rope.positions[ct] * rope.inv_freq[e % (D / 2)], sn, cs);
        cs *= rope.scale;
        sn *= rope.scale;
    } else {
        cs = rope.cos[ct * D + e];
        sn = rope.sin[ct * D + e];
    }
}

// Group gi of coded row ct (zeros for an invalid one) after the inverse rotation's S_p transform, left in zbuf
// for the outer mix (higgs_mixed); returns its scale (0 when invalid). The lanes' grid points, the butterflies
// in the lane, then across the token's lanes by shuffles, then by shared memory for strides of 256 and up.
// Every thread of the CTA calls it (shuffles, __syncthreads); zbuf holds two rounds of nseg * P floats (zr
// counts the rounds: one __syncthreads a round); z is set to this lane group's P floats of the last round.
__device__ __forceinline__ float higgs_unrotate(const unsigned char* codes, const unsigned short* scales, int cb,
                                                long long ct, bool valid, int gi, int cc, int sub, int group,
                                                int row_bytes, int G, int P, int p, const float* grid, float* zbuf,
                                                int& zr, const float*& zout) {
    float x[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = 0.0f;
    float scale = 0.0f;
    if (valid) {
        if (cc < P) lane_points(codes + ct * row_bytes, gi * (P / 2) + cc / 2, cb, grid, x);
        scale = higgs_h2f(scales[ct * G + gi]);
    }
#pragma unroll
    for (int h = 1; h < 8; h <<= 1) {
        if (h >= p) break;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            if (j & h) continue;
            const float a = x[j], c = x[j | h];
            x[j] = a + c;
            x[j | h] = a - c;
        }
    }
    for (int h = 8; h < p && h < 256; h <<= 1) {
        const bool hi = (sub & (h >> 3)) != 0;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float o = __shfl_xor_sync(HIGGS_FULL_MASK, x[j], h >> 3);
            x[j] = hi ? o - x[j] : x[j] + o;
        }
    }
    for (int h = 256; h < p; h <<= 1) {
        float* z = zbuf + (zr++ & 1) * 1024 + group * P;
        if (cc < P) {
#pragma unroll
            for (int j = 0; j < 8; ++j) z[cc + j] = x[j];
        }
        __syncthreads();
        if (cc < P) {
            const bool hi = (cc & h) != 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const float o = z[(cc ^ h) + j];
                x[j] = hi ? o - x[j] : x[j] + o;
            }
        }
    }
    float* z = zbuf + (zr++ & 1) * 1024 + group * P;
    if (cc < P) {
#pragma unroll
        for (int j = 0; j < 8; ++j) z[cc + j] = x[j];
    }
    __syncthreads();
    zout = z;
    return scale;
}

// Pre-RoPE key of token t at the lane's 8 channels cc.. of the group (zeros past the group's heads or for
// t past the split, valid false), and its scale: higgs_unrotate, the outer mix, signs / sqrt(P) (sg), and
// RoPE at the token's position, pairing channel e of a head with e +- D/2, both read from shared memory.
// Every thread of the CTA calls it (higgs_unrotate).
__device__ __forceinline__ float rebuild_key(const HiggsSide& s, const HiggsRope& rope, int cb, int t, bool valid,
                                             int b, int gi, int cc, int sub, int group, int ns, int nc,
                                             int row_bytes, int G, int D, int P, int p, int m, int heads,
                                             const float* grid, const float* sg, const float* outer, float* zbuf,
                                             int& zr, float (&k)[8]) {
    const long long ct = (long long)b * nc + (t - ns);
    const float* z;
    const float scale =
        higgs_unrotate(s.codes, s.scale, cb, ct, valid, gi, cc, sub, group, row_bytes, G, P, p, grid, zbuf, zr, z);
#pragma unroll
    for (int j = 0; j < 8; ++j) k[j] = 0.0f;
    if (valid && cc < heads * D) {
        const int half = D / 2;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int c = cc + j, e = c % D, c2 = c - e + (e + half) % D;
            float cs, sn;
            higgs_rope_at(rope, ct, e, D, cs, sn);
            const float a = higgs_mixed(z, outer, m, p, c) * sg[c];
            const float o = higgs_mixed(z, outer, m, p, c2) * sg[c2];
            k[j] = fmaf(a, cs, (e < half ? -o : o) * sn);
        }
    }
    return scale;
}

// 8 consecutive fp32 values (16-byte aligned).
__device__ __forceinline__ void higgs_float8(const float* p, float (&x)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p), c = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = c.x, x[5] = c.y, x[6] = c.z, x[7] = c.w;
}

// An AQUA-KV key of the workspace (ROWS): coded token t's pre-RoPE row [Hkv*D] fp32 at the lane's 8 channels
// cc.. of the group's heads (from channel gi*HPG*D of the row), RoPE applied as rebuild_key applies it, the
// partner channels read from the row (one 32-byte run where D/2 is a multiple of 8, else one by one).
__device__ __forceinline__ void row_key(const float* rows, const HiggsRope& rope, int t, int b, int gi, int cc,
                                        int ns, int nc, int Hkv, int HPG, int D, float (&k)[8]) {
    const long long ct = (long long)b * nc + (t - ns);
    const float* x = rows + ct * Hkv * D + (long long)gi * HPG * D;
    const int half = D / 2, e0 = cc % D;
    float a[8], o[8];
    higgs_float8(x + cc, a);
    if (half % 8 == 0) {
        higgs_float8(x + cc - e0 + (e0 + half) % D, o);
    } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int e = e0 + j;
            o[j] = x[cc + j - e + (e + half) % D];
        }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int e = e0 + j;  // D a multiple of 8: the lane's channels lie in one head
        float cs, sn;
        higgs_rope_at(rope, ct, e, D, cs, sn);
        k[j] = fmaf(a[j], cs, (e < half ? -o[j] : o[j]) * sn);
    }
}

// MODE 0: codes of keys coded after RoPE (scored in the rotated domain); 1: codes of keys coded before RoPE
// (rebuild_key); 2: an AQUA-KV workspace (ROWS), the coded part read from fp32 rows [B, nc, Hkv*D] (krows,
// vrows: row_key, row_value), no codes, no grid, values summed in the plain domain.
template <int RT, int U, int MODE>
__device__ __forceinline__ void attend_higgs(
    const float* __restrict__ q, const float* __restrict__ qt, HiggsSide ks, HiggsSide vs,
    const float* __restrict__ krows, const float* __restrict__ vrows, int ns, int nc, int nr,
    int row_bytes, int cb, const float* __restrict__ grid_g, int n_grid, const void* mask, int mask_kind, long long mb,
    long long mh, long long mq, long long mt, int Hkv, int g, int Q, int D, int P, int HPG, int RM, int G, int n0,
    int chunk0, int n1, int chunk1, int chunk2, int causal, float scaling, int lpt, HiggsRope rope,
    const float* __restrict__ signs, const float* __restrict__ outer_g, int om, int p, float inv_sqrt_p,
    float* __restrict__ part_acc, float* __restrict__ part_ml) {
    extern __shared__ float smem[];
    const int L = ns + nc + nr;
    const int split = blockIdx.x, bg = blockIdx.y, row0 = blockIdx.z * RT;
    const int b = bg / G, gi = bg % G;
    const int heads = min(HPG, Hkv - gi * HPG);
    const int nrows = min(RT, heads * g * Q - row0);
    if (nrows <= 0) return;  // a tile past the last group's rows (the whole CTA)
    int seg, tb, te;
    if (split < n0) {
        seg = 0;
        tb = split * chunk0;
        te = min(ns, tb + chunk0);
    } else if (split < n0 + n1) {
        seg = 1;
        tb = ns + (split - n0) * chunk1;
        te = min(ns + nc, tb + chunk1);
    } else {
        seg = 2;
        tb = ns + nc + (split - n0 - n1) * chunk2;
        te = min(L, tb + chunk2);
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int nseg = HIGGS_THREADS / lpt, group = threadIdx.x / lpt, sub = threadIdx.x % lpt, cc = 8 * sub;
    const bool rows = MODE == 2 && seg == 1;  // the workspace's rows (CTA-uniform)
    const bool active = seg == 1 && !rows ? cc < P : cc < heads * D;
    const int hl = cc / D;  // the lane's head within the group (fp16 parts, pre-RoPE keys, rows)
    const bool pre = MODE == 1 && seg == 1;  // keys rebuilt per token (CTA-uniform)
    const bool rotated = MODE == 0 && seg == 1;  // scored against the rotated queries

    float* grid = smem;  // the grid's points, 2 floats each
    float* red = grid + 2 * n_grid;  // [2][HIGGS_WARPS][U][RT]: warps' partial dot products (LPT > 32)
    float* sg = red + 2 * HIGGS_WARPS * U * RT;  // pre-RoPE keys: signs / sqrt(P) [P], outer [m][m]
    float* outer = sg + (MODE == 1 ? P : 0);
    float* sm_m = outer + (MODE == 1 ? om * om : 0);
    float* sm_l = sm_m + nseg * RT;
    float* sm_acc = sm_l + nseg * RT;
    float* zbuf = sm_m;  // pre-RoPE keys: [2][1024] rounds of the groups' coordinates, before the final merge
    for (int i = threadIdx.x; i < 2 * n_grid; i += HIGGS_THREADS) grid[i] = grid_g[i];
    if (MODE == 1) {
        for (int i = threadIdx.x; i < P; i += HIGGS_THREADS) sg[i] = signs[i] * inv_sqrt_p;
        for (int i = threadIdx.x; i < om * om; i += HIGGS_THREADS) outer[i] = outer_g[i];
    }
    __syncthreads();

    float qr[RT][8], acc[RT][8], m[RT], l[RT];
    long long moff[RT];
    int limit[RT];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        const int row = row0 + r;
        const bool mine = r < nrows && active && (rotated || (cc < heads * D && hl == row / (g * Q)));
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            float x = 0.0f;
            if (mine) {
                const long long at = (long long)bg * RM + row;
                x = rotated ? qt[at * P + cc + j] : q[at * D + cc % D + j];
            }
            qr[r][j] = x;
            acc[r][j] = 0.0f;
        }
        m[r] = HIGGS_NEG_INF;
        l[r] = 0.0f;
        const int qh = gi * HPG * g + row / Q, i = row % Q;
        moff[r] = b * mb + qh * mh + i * mq;
        limit[r] = r >= nrows ? 0 : (causal ? L - Q + i + 1 : L);
    }

    const int width = min(lpt, 32), wpt = lpt / 32;  // lanes of a token within a warp; warps of a token
    int it = 0, zr = 0;
    for (int base = tb; base < te; base += nseg * U, ++it) {
        float s[U][RT], sc[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * nseg + group;
            float k[8];
            sc[u] = 0.0f;
            if (pre) {
                sc[u] = rebuild_key(ks, rope, cb, t, t < te, b, gi, cc, sub, group, ns, nc, row_bytes, G, D, P, p, om,
                                    heads, grid, sg, outer, zbuf, zr, k);
            } else if (rows) {
                sc[u] = 1.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) k[j] = 0.0f;
                if (t < te && active) row_key(krows, rope, t, b, gi, cc, ns, nc, Hkv, HPG, D, k);
            } else if (t < te) {
                sc[u] =
                    load_token(ks, seg, cb, t, b, gi, cc, active, ns, nc, nr, row_bytes, G, Hkv, HPG, D, P, grid, k);
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j) k[j] = 0.0f;
            }
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                float x = 0.0f;
#pragma unroll
                for (int j = 0; j < 8; ++j) x = fmaf(qr[r][j], k[j], x);
                for (int o = width >> 1; o > 0; o >>= 1) x += __shfl_xor_sync(HIGGS_FULL_MASK, x, o);
                s[u][r] = x;
            }
        }
        if (wpt > 1) {  // a token over 2 or 4 warps: their sums meet in shared memory, in warp order
            float* buf = red + (it & 1) * HIGGS_WARPS * U * RT;
            if (lane == 0) {
#pragma unroll
                for (int u = 0; u < U; ++u)
#pragma unroll
                    for (int r = 0; r < RT; ++r) buf[(warp * U + u) * RT + r] = s[u][r];
            }
            __syncthreads();
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int r = 0; r < RT; ++r) {
                    float x = 0.0f;
                    for (int w = 0; w < wpt; ++w) x += buf[((group * wpt + w) * U + u) * RT + r];
                    s[u][r] = x;
                }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * nseg + group;
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                float x = s[u][r] * sc[u] * scaling;
                if (t >= te || t >= limit[r]) {
                    x = HIGGS_NEG_INF;
                } else if (mask_kind == 1) {
                    if (!reinterpret_cast<const unsigned char*>(mask)[moff[r] + t * mt]) x = HIGGS_NEG_INF;
                } else if (mask_kind == 2) {
                    x += reinterpret_cast<const float*>(mask)[moff[r] + t * mt];
                }
                s[u][r] = x;
            }
        }
        // Online softmax over the U tokens, per row (every lane of a group holds the same numbers).
#pragma unroll
        for (int r = 0; r < RT; ++r) {
            float mx = m[r];
#pragma unroll
            for (int u = 0; u < U; ++u) mx = fmaxf(mx, s[u][r]);
            if (mx == HIGGS_NEG_INF) {
#pragma unroll
                for (int u = 0; u < U; ++u) s[u][r] = 0.0f;
                continue;
            }
            const float alpha = expf(m[r] - mx);  // 0 while m is -inf
            float sum = 0.0f;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                s[u][r] = expf(s[u][r] - mx);
                sum += s[u][r];
            }
            l[r] = l[r] * alpha + sum;
            m[r] = mx;
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[r][j] *= alpha;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int t = base + u * nseg + group;
            if (t >= te || !active) continue;
            float v[8];
            float vsc = 1.0f;
            if (rows)
                higgs_float8(vrows + ((long long)b * nc + (t - ns)) * Hkv * D + (long long)gi * HPG * D + cc, v);
            else
                vsc = load_token(vs, seg, cb, t, b, gi, cc, active, ns, nc, nr, row_bytes, G, Hkv, HPG, D, P, grid, v);
#pragma unroll
            for (int r = 0; r < RT; ++r) {
                const float w = s[u][r] * vsc;
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[r][j] = fmaf(w, v[j], acc[r][j]);
            }
        }
    }

    // Merge the lane groups: m, l [nseg][RT], acc [nseg][RT][8*lpt] (lpt * 8 >= P).
    const int dp = 8 * lpt;
    if (pre) __syncthreads();  // the last round's reads of zbuf, which the merge overwrites
#pragma unroll
    for (int r = 0; r < RT; ++r) {
        if (sub == 0) {
            sm_m[group * RT + r] = m[r];
            sm_l[group * RT + r] = l[r];
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) sm_acc[(group * RT + r) * dp + cc + j] = acc[r][j];
    }
    __syncthreads();
    for (int i = threadIdx.x; i < nrows * P; i += HIGGS_THREADS) {
        const int r = i / P, c = i % P;
        float mx = HIGGS_NEG_INF;
        for (int gs = 0; gs < nseg; ++gs) mx = fmaxf(mx, sm_m[gs * RT + r]);
        float o = 0.0f, den = 0.0f;
        if (mx != HIGGS_NEG_INF) {
            for (int gs = 0; gs < nseg; ++gs) {
                const float mg = sm_m[gs * RT + r];
                if (mg == HIGGS_NEG_INF) continue;
                const float wgt = expf(mg - mx);
                o = fmaf(wgt, sm_acc[(gs * RT + r) * dp + c], o);
                den = fmaf(wgt, sm_l[gs * RT + r], den);
            }
        }
        const long long prow = ((long long)split * gridDim.y + bg) * RM + row0 + r;
        part_acc[prow * P + c] = o;
        if (c == 0) {
            part_ml[prow * 2] = mx;
            part_ml[prow * 2 + 1] = den;
        }
    }
}

// One block per output row (b, query head, position) of out [B, Hq*Q, D] fp32: the log-sum-exp merge of
// the splits, the code splits' rotated-domain sums rotated back once (kron(outer, S_p)^T, signs,
// 1/sqrt(P)) at the row's D channels, added to the fp16 splits' plain sums. A row that sees no key
// gives zeros. Shared memory: P floats.
extern "C" __global__ void higgs_merge(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                                       int n_split, int n0, int n1, int BG, int G, int RM, int P, int D, int gQ,
                                       int HQ_Q, const float* __restrict__ signs, const float* __restrict__ outer,
                                       int m, int p, float inv_sqrt_p, float* __restrict__ out) {
    extern __shared__ float rot[];
    const int row = blockIdx.x;
    const int b = row / HQ_Q, f = row % HQ_Q, gi = f / RM, r = f % RM, c0 = (r / gQ) * D;
    const long long bg = (long long)b * G + gi;
    float mx = HIGGS_NEG_INF;
    for (int sp = 0; sp < n_split; ++sp) mx = fmaxf(mx, part_ml[(((long long)sp * BG + bg) * RM + r) * 2]);
    float den = 0.0f;
    if (mx != HIGGS_NEG_INF) {
        for (int sp = 0; sp < n_split; ++sp) {
            const long long pr = ((long long)sp * BG + bg) * RM + r;
            const float ms = part_ml[pr * 2];
            if (ms != HIGGS_NEG_INF) den = fmaf(expf(ms - mx), part_ml[pr * 2 + 1], den);
        }
    }
    for (int j = threadIdx.x; j < P; j += blockDim.x) {
        float o = 0.0f;
        if (mx != HIGGS_NEG_INF) {
            for (int sp = n0; sp < n0 + n1; ++sp) {
                const long long pr = ((long long)sp * BG + bg) * RM + r;
                const float ms = part_ml[pr * 2];
                if (ms != HIGGS_NEG_INF) o = fmaf(expf(ms - mx), part_acc[pr * P + j], o);
            }
        }
        rot[j] = o;
    }
    __syncthreads();
    for (int c = threadIdx.x; c < D; c += blockDim.x) {
        float o = 0.0f;
        if (mx != HIGGS_NEG_INF) {
            float plain = 0.0f;
            for (int sp = 0; sp < n_split; ++sp) {
                if (sp >= n0 && sp < n0 + n1) continue;
                const long long pr = ((long long)sp * BG + bg) * RM + r;
                const float ms = part_ml[pr * 2];
                if (ms != HIGGS_NEG_INF) plain = fmaf(expf(ms - mx), part_acc[pr * P + c0 + c], plain);
            }
            const int ch = c0 + c, hi = ch / p, lo = ch % p;
            float back = 0.0f;
            if (n1 > 0) {  // no code split (nothing coded, or an AQUA-KV workspace): nothing to rotate back
                for (int j = 0; j < P; ++j) {
                    const float h = outer[hi * m + j / p];
                    back = fmaf(rot[j], (__popc(lo & (j % p)) & 1) ? -h : h, back);
                }
                back = signs[ch] * back * inv_sqrt_p;
            }
            o = (plain + back) / den;
        }
        out[(long long)row * D + c] = o;
    }
}

#define HIGGS_KERNEL(NAME, RT, U, MODE)                                                                                   \
    extern "C" __global__ void __launch_bounds__(HIGGS_THREADS, 1) NAME(                                             \
        const float* q, const float* qt, const unsigned char* kcodes, const unsigned short* kscale,                  \
        const unsigned short* ksink, const unsigned short* krecent, const unsigned char* vcodes,                     \
        const unsigned short* vscale, const unsigned short* vsink, const unsigned short* vrecent, const float* krows, \
        const float* vrows, int ns, int nc,                                                                          \
        int nr, int row_bytes, int cb, const float* grid, int n_grid, const void* mask, int mask_kind, long long mb, \
        long long mh, long long mq, long long mt, int Hkv, int g, int Q, int D, int P, int HPG, int RM, int G,       \
        int n0, int chunk0, int n1, int chunk1, int chunk2, int causal, float scaling, int lpt, int rope_kind,       \
        const int* positions, const float* inv_freq, float rope_scale, const float* rope_cos, const float* rope_sin, \
        const float* signs, const float* outer, int om, int p, float inv_sqrt_p, float* part_acc, float* part_ml) {  \
        const HiggsSide ks = {kcodes, kscale, ksink, krecent};                                                       \
        const HiggsSide vs = {vcodes, vscale, vsink, vrecent};                                                       \
        const HiggsRope rope = {rope_kind, positions, inv_freq, rope_scale, rope_cos, rope_sin};                     \
        attend_higgs<RT, U, MODE>(q, qt, ks, vs, krows, vrows, ns, nc, nr, row_bytes, cb, grid, n_grid, mask, mask_kind, mb, mh, mq, mt, \
                            Hkv, g, Q, D, P, HPG, RM, G, n0, chunk0, n1, chunk1, chunk2, causal, scaling, lpt, rope, \
                            signs, outer, om, p, inv_sqrt_p, part_acc, part_ml);                                     \
    }

HIGGS_KERNEL(higgs_r1, 1, 4, 0)
HIGGS_KERNEL(higgs_r2, 2, 4, 0)
HIGGS_KERNEL(higgs_r4, 4, 4, 0)
HIGGS_KERNEL(higgs_r8, 8, 2, 0)
HIGGS_KERNEL(higgs_pre_r1, 1, 2, 1)
HIGGS_KERNEL(higgs_pre_r4, 4, 2, 1)
HIGGS_KERNEL(higgs_pre_r8, 8, 1, 1)
HIGGS_KERNEL(higgs_rows_r1, 1, 4, 2)
HIGGS_KERNEL(higgs_rows_r2, 2, 4, 2)
HIGGS_KERNEL(higgs_rows_r4, 4, 4, 2)

// AQUA-KV's residual decode (kernels_cupy.aquakv.reconstruct, before the predictions are added by cuBLAS):
// side blockIdx.z (0 keys, 1 values), coded row r = blockIdx.x * NSEG + lane group of [rows] (B*nc), quantizer
// group gi = blockIdx.y: out[r, gi*qgroup + c] = s * (H^T y)[c] * signs[c] / sqrt(P) (+ bias[gi*qgroup + c])
// for c < min(qgroup, C - gi*qgroup), as kvquant.quant.higgs.Higgs.dequantize (higgs_unrotate, the outer mix).
// out is contiguous [rows, C] fp32 (the cache's workspace). Grid (ceil(rows / NSEG), G, 2), HIGGS_THREADS
// threads; shared memory: the grid's points, signs / sqrt(P), the outer factor, two rounds of coordinates.
extern "C" __global__ void __launch_bounds__(HIGGS_THREADS) higgs_decode(
    const unsigned char* __restrict__ kcodes, const unsigned short* __restrict__ kscale,
    const unsigned char* __restrict__ vcodes, const unsigned short* __restrict__ vscale, const float* kbias,
    const float* vbias, long long rows, int row_bytes, int cb, const float* __restrict__ grid_g, int n_grid, int G,
    int qgroup, int C, int P, int lpt, const float* __restrict__ signs, const float* __restrict__ outer_g, int om,
    int p, float inv_sqrt_p, float* kout, float* vout) {
    extern __shared__ float decode_smem[];
    float* grid = decode_smem;
    float* sg = grid + 2 * n_grid;
    float* outer = sg + P;
    float* zbuf = outer + om * om;
    for (int i = threadIdx.x; i < 2 * n_grid; i += HIGGS_THREADS) grid[i] = grid_g[i];
    for (int i = threadIdx.x; i < P; i += HIGGS_THREADS) sg[i] = signs[i] * inv_sqrt_p;
    for (int i = threadIdx.x; i < om * om; i += HIGGS_THREADS) outer[i] = outer_g[i];
    __syncthreads();
    const int nseg = HIGGS_THREADS / lpt, group = threadIdx.x / lpt, sub = threadIdx.x % lpt, cc = 8 * sub;
    const int gi = blockIdx.y, side = blockIdx.z;
    const long long r = (long long)blockIdx.x * nseg + group;
    const bool valid = r < rows;
    int zr = 0;
    const float* z;
    const float s = higgs_unrotate(side ? vcodes : kcodes, side ? vscale : kscale, cb, r, valid, gi, cc, sub, group,
                                   row_bytes, G, P, p, grid, zbuf, zr, z);
    if (!valid) return;
    const float* bias = side ? vbias : kbias;
    float* out = (side ? vout : kout) + r * C + (long long)gi * qgroup;
    const int cn = min(qgroup, C - gi * qgroup);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        const int c = cc + j;
        if (c >= cn) break;
        float x = s * (higgs_mixed(z, outer, om, p, c) * sg[c]);
        if (bias != nullptr) x += bias[gi * qgroup + c];
        out[c] = x;
    }
}
