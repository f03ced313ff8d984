// msl_types.h -- Metal Shading Language scalar/vector/math/atomic types for the
// CPU emulator (xlstm_kernels.emulate).  Pure types + math only; the scheduler,
// barriers, simd collectives and simdgroup_matrix live elsewhere.
//
// Rules this header follows (see the emulator design notes):
//  * only <stdint.h>, <stddef.h>, <string.h> are included, so that after
//    `using namespace metal;` a call like exp(x) is never ambiguous with libm;
//    all math goes through GCC builtins;
//  * no function-local statics, no mutable globals (kernels are dlopen'd many
//    times into one process);
//  * every vector / scalar type is trivially copyable with a trivial default
//    constructor, so it can live in unions and threadgroup arrays;
//  * Metal layouts: vec<T,3> has the size and alignment of 4 elements.
//
// API summary (everything lives in namespace metal; `using namespace metal;`
// is done at the end):
//  scalars   half (= _Float16), bfloat (uint16_t `bits`, RNE from float,
//            bfloat::from_bits), uint ushort uchar ulong; float16_t, bfloat16_t.
//            bfloat op bfloat/int -> bfloat, bfloat op float/half -> float.
//  vectors   vec<T,N> (N = 2,3,4), <type><N> and packed_<type><N> typedefs for
//            float half bfloat int uint short ushort char uchar bool long ulong;
//            .x.y.z.w/.r.g.b.a, [i], splat, pieces ctors, explicit element
//            conversion, swizzles (contiguous ones assignable), elementwise ops
//            with vectors or scalars (scalar converted to the element type),
//            comparisons -> vec<bool,N>.  msl_detail::vi<X>::n / ::E / ::V and
//            msl_detail::tov(x) describe/normalise vector-like values.
//  math      float-computed, rounded to half/bfloat, lane-wise on vectors; same
//            names in metal::precise and metal::fast.  as_type, numeric_limits.
//  atomics   atomic<T> (layout of T), atomic_int/uint/float/bool/long/ulong,
//            atomic_*_explicit (all seq_cst), memory_order.
//
// Address-space macros (device, constant, thread, threadgroup, ray_data,
// object_data) are defined at the END of this file; define
// MSL_NO_ADDRESS_SPACE_MACROS before including to suppress them.  Include any
// system header (<thread>, <vector>, ...) BEFORE this file.
#ifndef XLSTM_EMULATE_MSL_TYPES_H
#define XLSTM_EMULATE_MSL_TYPES_H

#include <stdint.h>
#include <stddef.h>
#include <string.h>

// ----------------------------------------------------------------- scalars
#if defined(__aarch64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13 && defined(__cplusplus)
// GCC < 13 has no _Float16 in C++ on aarch64: use the ARM storage type, whose
// arithmetic promotes to float (results round to half when stored, as in Metal).
typedef __fp16 half;
#else
typedef _Float16 half;
#endif
typedef unsigned int uint;       // identical to glibc <sys/types.h>
typedef unsigned short ushort;   // identical to glibc <sys/types.h>
typedef unsigned long ulong;     // identical to glibc <sys/types.h> (64-bit, LP64)
typedef unsigned char uchar;

namespace metal {
using ::half;
using ::uint;
using ::ushort;
using ::uchar;
using ::ulong;
struct bfloat;
template <class T, int N> struct vec;
template <class T, int N> struct packed_vec;
template <class T, int K> struct cswz;
template <class T, int S, int... I> struct pswz;

namespace msl_detail {
template <bool B, class T = void> struct en {};
template <class T> struct en<true, T> { typedef T type; };
template <bool B, class A, class C> struct cond { typedef A type; };
template <class A, class C> struct cond<false, A, C> { typedef C type; };
template <class T> struct idt { typedef T type; };
template <class A, class B> struct same { static constexpr int v = 0; };
template <class A> struct same<A, A> { static constexpr int v = 1; };

// scalar kind: 0 = not a scalar, 1 = integer / bool, 2 = floating point
template <class T> struct sk { static constexpr int v = 0; };
#define MSL_SK_(T, k) template <> struct sk<T> { static constexpr int v = k; };
MSL_SK_(bool, 1) MSL_SK_(char, 1) MSL_SK_(signed char, 1) MSL_SK_(unsigned char, 1)
MSL_SK_(short, 1) MSL_SK_(unsigned short, 1) MSL_SK_(int, 1) MSL_SK_(unsigned, 1)
MSL_SK_(long, 1) MSL_SK_(unsigned long, 1) MSL_SK_(long long, 1) MSL_SK_(unsigned long long, 1)
MSL_SK_(float, 2) MSL_SK_(double, 2) MSL_SK_(half, 2) MSL_SK_(bfloat, 2)
#undef MSL_SK_

constexpr inline uint32_t f2u(float f) { return __builtin_bit_cast(uint32_t, f); }
constexpr inline float u2f(uint32_t u) { return __builtin_bit_cast(float, u); }
// float -> bfloat16 bits, round to nearest even; NaN stays NaN (quieted).
constexpr inline uint16_t f2bf(float f) {
  uint32_t u = f2u(f);
  return (u & 0x7fffffffu) > 0x7f800000u ? uint16_t((u >> 16) | 0x40u)
                                          : uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
struct raw_t {};
}  // namespace msl_detail

// ----------------------------------------------------------------- bfloat
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  constexpr bfloat(msl_detail::raw_t, uint16_t b) : bits(b) {}
  template <class S, typename msl_detail::en<(msl_detail::sk<S>::v > 0), int>::type = 0>
  constexpr bfloat(S s) : bits(msl_detail::f2bf(float(s))) {}
  constexpr operator float() const { return msl_detail::u2f(uint32_t(bits) << 16); }
  static constexpr bfloat from_bits(uint16_t b) { return bfloat(msl_detail::raw_t(), b); }
#define MSL_BF_CA_(op)                                                       \
  template <class S> bfloat& operator op##=(const S& s) {                   \
    bits = msl_detail::f2bf(float(*this) op float(s));                      \
    return *this;                                                            \
  }
  MSL_BF_CA_(+) MSL_BF_CA_(-) MSL_BF_CA_(*) MSL_BF_CA_(/)
#undef MSL_BF_CA_
  bfloat& operator++() { return *this += 1.0f; }
  bfloat& operator--() { return *this -= 1.0f; }
  bfloat operator++(int) { bfloat t = *this; *this += 1.0f; return t; }
  bfloat operator--(int) { bfloat t = *this; *this -= 1.0f; return t; }
};
constexpr inline bfloat operator-(bfloat a) { return bfloat(msl_detail::raw_t(), uint16_t(a.bits ^ 0x8000u)); }
constexpr inline bfloat operator+(bfloat a) { return a; }
// bfloat op bfloat -> bfloat; bfloat op integer -> bfloat;
// bfloat op (float|half|double) -> float.  All computed in float.
#define MSL_BF_OP_(op)                                                                         \
  inline bfloat operator op(bfloat a, bfloat b) { return bfloat(float(a) op float(b)); }       \
  template <class S>                                                                           \
  inline typename msl_detail::en<msl_detail::sk<S>::v == 1, bfloat>::type operator op(bfloat a, S b) { \
    return bfloat(float(a) op float(b));                                                       \
  }                                                                                            \
  template <class S>                                                                           \
  inline typename msl_detail::en<msl_detail::sk<S>::v == 1, bfloat>::type operator op(S a, bfloat b) { \
    return bfloat(float(a) op float(b));                                                       \
  }                                                                                            \
  template <class S>                                                                           \
  inline typename msl_detail::en<msl_detail::sk<S>::v == 2 && !msl_detail::same<S, bfloat>::v, float>::type \
  operator op(bfloat a, S b) { return float(a) op float(b); }                                  \
  template <class S>                                                                           \
  inline typename msl_detail::en<msl_detail::sk<S>::v == 2 && !msl_detail::same<S, bfloat>::v, float>::type \
  operator op(S a, bfloat b) { return float(a) op float(b); }
MSL_BF_OP_(+) MSL_BF_OP_(-) MSL_BF_OP_(*) MSL_BF_OP_(/)
#undef MSL_BF_OP_
#define MSL_BF_CMP_(op)                                                                        \
  inline bool operator op(bfloat a, bfloat b) { return float(a) op float(b); }                 \
  template <class S>                                                                           \
  inline typename msl_detail::en<(msl_detail::sk<S>::v > 0) && !msl_detail::same<S, bfloat>::v, bool>::type \
  operator op(bfloat a, S b) { return float(a) op float(b); }                                  \
  template <class S>                                                                           \
  inline typename msl_detail::en<(msl_detail::sk<S>::v > 0) && !msl_detail::same<S, bfloat>::v, bool>::type \
  operator op(S a, bfloat b) { return float(a) op float(b); }
MSL_BF_CMP_(==) MSL_BF_CMP_(!=) MSL_BF_CMP_(<) MSL_BF_CMP_(>) MSL_BF_CMP_(<=) MSL_BF_CMP_(>=)
#undef MSL_BF_CMP_

// ----------------------------------------------------------------- vectors
namespace msl_detail {
// vector info: n = number of lanes (0: not vector-like), E = element, V = vec<E,n>
template <class X> struct vi { static constexpr int n = 0; };
template <class T, int N> struct vi<vec<T, N> > { static constexpr int n = N; typedef T E; typedef vec<T, N> V; };
template <class T, int N> struct vi<packed_vec<T, N> > { static constexpr int n = N; typedef T E; typedef vec<T, N> V; };
template <class T, int K> struct vi<cswz<T, K> > { static constexpr int n = K; typedef T E; typedef vec<T, K> V; };
template <class T, int S, int... I> struct vi<pswz<T, S, I...> > {
  static constexpr int n = sizeof...(I); typedef T E; typedef vec<T, sizeof...(I)> V;
};
// element type of a scalar or vector-like type (only defined when valid)
template <class X, bool ok> struct ai0 {};
template <class X> struct ai0<X, true> { typedef X E; };
template <class X, int n = vi<X>::n> struct ai { typedef typename vi<X>::E E; };
template <class X> struct ai<X, 0> : ai0<X, (sk<X>::v > 0)> {};

template <class T, int N> inline const vec<T, N>& tov(const vec<T, N>& x) { return x; }
template <class X> inline typename vi<X>::V tov(const X& x) { return x.get(); }

// lane count of a constructor piece (scalar: 1, vector-like: n, other: huge)
template <class X> struct pc { static constexpr int v = vi<X>::n ? vi<X>::n : (sk<X>::v ? 1 : 1000); };
template <class... X> struct pcs { static constexpr int v = 0; };
template <class X, class... R> struct pcs<X, R...> { static constexpr int v = pc<X>::v + pcs<R...>::v; };

template <class T, class X> inline void vput(T* dst, int& k, const X& x) {
  if constexpr (vi<X>::n == 0) {
    dst[k++] = T(x);
  } else {
    const auto& t = tov(x);
    for (int i = 0; i < int(vi<X>::n); ++i) dst[k++] = T(t.v[i]);
  }
}
}  // namespace msl_detail

#define MSL_SWZ_COMMON_(K)                                                       \
  T& operator[](int i) { return this->v[IDX(i)]; }                               \
  const T& operator[](int i) const { return this->v[IDX(i)]; }                   \
  operator vec<T, K>() const { return get(); }                                   \
  template <class B> auto& operator+=(const B& b) { return *this = get() + b; }  \
  template <class B> auto& operator-=(const B& b) { return *this = get() - b; }  \
  template <class B> auto& operator*=(const B& b) { return *this = get() * b; }  \
  template <class B> auto& operator/=(const B& b) { return *this = get() / b; }  \
  template <class B> auto& operator%=(const B& b) { return *this = get() % b; }  \
  template <class B> auto& operator&=(const B& b) { return *this = get() & b; }  \
  template <class B> auto& operator|=(const B& b) { return *this = get() | b; }  \
  template <class B> auto& operator^=(const B& b) { return *this = get() ^ b; }  \
  template <class B> auto& operator<<=(const B& b) { return *this = get() << b; } \
  template <class B> auto& operator>>=(const B& b) { return *this = get() >> b; }

// Contiguous swizzle view (.xy .yz .zw .xyz .yzw .rg ...): only covers its own
// lanes, so even the implicit (trivial) copy assignment `a.zw = b.xy` is right.
template <class T, int K> struct cstore;
template <class T> struct cstore<T, 2> { union { T v[2]; struct { T x, y; }; }; };
template <class T> struct cstore<T, 3> { union { T v[3]; struct { T x, y, z; }; }; };
template <class T> struct cstore<T, 4> { union { T v[4]; struct { T x, y, z, w; }; }; };
template <class T, int K> struct cswz : cstore<T, K> {
  static int IDX(int i) { return i; }
  vec<T, K> get() const { vec<T, K> r; for (int i = 0; i < K; ++i) r.v[i] = this->v[i]; return r; }
  cswz& operator=(const vec<T, K>& o) { for (int i = 0; i < K; ++i) this->v[i] = o.v[i]; return *this; }
  MSL_SWZ_COMMON_(K)
};
// Non-contiguous / permuted swizzle view (.xz .yw .yx .zyx ...).  S = lanes of
// the owning vector.  Assigning a vec works; assigning the same swizzle of
// another non-const vector (`a.xz = b.xz`) is a compile error (use
// `a.xz = float2(b.xz)`); with a const source it would silently copy the whole
// span -- do not do that.
template <class T, int S, int... I> struct pswz {
  T v[S];
  pswz() = default;
  pswz(const pswz&) = default;
  pswz& operator=(const pswz&) = default;
  pswz& operator=(pswz&) = delete;
  pswz& operator=(pswz&&) = delete;
  static int IDX(int i) { const int ix[] = {I...}; return ix[i]; }
  vec<T, sizeof...(I)> get() const { return vec<T, sizeof...(I)>(v[I]...); }
  pswz& operator=(const vec<T, sizeof...(I)>& o) {
    const vec<T, sizeof...(I)> t = o;
    int k = 0;
    ((v[I] = t.v[k++]), ...);
    return *this;
  }
  MSL_SWZ_COMMON_(int(sizeof...(I)))
};
#undef MSL_SWZ_COMMON_

template <class T, int N> struct vstore;
template <class T> struct alignas(2 * sizeof(T)) vstore<T, 2> {
  union {
    T v[2];
    struct { T x, y; };
    struct { T r, g; };
    cswz<T, 2> xy, rg;
    pswz<T, 2, 1, 0> yx, gr;
    pswz<T, 2, 0, 0> xx;
    pswz<T, 2, 1, 1> yy;
  };
};
template <class T> struct alignas(4 * sizeof(T)) vstore<T, 3> {
  union {
    T v[3];
    struct { T x, y, z; };
    struct { T r, g, b; };
    cswz<T, 2> xy, rg;
    struct { T msl_p0_; cswz<T, 2> yz; };
    struct { T msl_p1_; cswz<T, 2> gb; };
    cswz<T, 3> xyz, rgb;
    pswz<T, 3, 0, 2> xz, rb;
    pswz<T, 3, 1, 0> yx;
    pswz<T, 3, 2, 1, 0> zyx, bgr;
  };
};
template <class T> struct alignas(4 * sizeof(T)) vstore<T, 4> {
  union {
    T v[4];
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    struct { cswz<T, 2> xy, zw; };
    struct { cswz<T, 2> rg, ba; };
    struct { T msl_p0_; cswz<T, 2> yz; };
    struct { T msl_p1_; cswz<T, 2> gb; };
    cswz<T, 3> xyz, rgb;
    struct { T msl_p2_; cswz<T, 3> yzw; };
    struct { T msl_p3_; cswz<T, 3> gba; };
    cswz<T, 4> xyzw, rgba;
    pswz<T, 4, 0, 2> xz, rb;
    pswz<T, 4, 0, 3> xw, ra;
    pswz<T, 4, 1, 3> yw, ga;
    pswz<T, 4, 1, 0> yx;
    pswz<T, 4, 2, 1, 0> zyx, bgr;
    pswz<T, 4, 2, 1, 0, 3> zyxw, bgra;
    pswz<T, 4, 3, 2, 1, 0> wzyx;
  };
};

template <class T, int N> struct vec : vstore<T, N> {
  typedef T value_type;
  vec() = default;
  // splat (implicit, as Metal's scalar -> vector conversion)
  template <class S, typename msl_detail::en<(msl_detail::sk<S>::v > 0), int>::type = 0>
  vec(const S& s) {
    const T t = T(s);
    for (int i = 0; i < N; ++i) this->v[i] = t;
  }
  // element-type conversion / swizzle / packed: explicit, like float4(h4)
  template <class A, typename msl_detail::en<int(msl_detail::vi<A>::n) == N, int>::type = 0>
  explicit vec(const A& a) {
    int k = 0;
    msl_detail::vput(this->v, k, a);
  }
  // pieces: float4(a,b,c,d), float4(f2, f, f), float4(f3, f), float4(f2, f2) ...
  template <class A0, class A1, class... As,
            typename msl_detail::en<int(msl_detail::pcs<A0, A1, As...>::v) == N, int>::type = 0>
  vec(const A0& a0, const A1& a1, const As&... as) {
    int k = 0;
    msl_detail::vput(this->v, k, a0);
    msl_detail::vput(this->v, k, a1);
    (msl_detail::vput(this->v, k, as), ...);
  }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }
  const vec& get() const { return *this; }
  template <class B> vec& operator+=(const B& b) { return *this = *this + b; }
  template <class B> vec& operator-=(const B& b) { return *this = *this - b; }
  template <class B> vec& operator*=(const B& b) { return *this = *this * b; }
  template <class B> vec& operator/=(const B& b) { return *this = *this / b; }
  template <class B> vec& operator%=(const B& b) { return *this = *this % b; }
  template <class B> vec& operator&=(const B& b) { return *this = *this & b; }
  template <class B> vec& operator|=(const B& b) { return *this = *this | b; }
  template <class B> vec& operator^=(const B& b) { return *this = *this ^ b; }
  template <class B> vec& operator<<=(const B& b) { return *this = *this << b; }
  template <class B> vec& operator>>=(const B& b) { return *this = *this >> b; }
  vec& operator++() { return *this = *this + T(1); }
  vec& operator--() { return *this = *this - T(1); }
  vec operator++(int) { vec t = *this; ++*this; return t; }
  vec operator--(int) { vec t = *this; --*this; return t; }
};

// packed_<type><n>: element-aligned, no padding (packed_float3 is 12 bytes)
template <class T, int N> struct pstore;
template <class T> struct pstore<T, 2> { union { T v[2]; struct { T x, y; }; struct { T r, g; }; }; };
template <class T> struct pstore<T, 3> { union { T v[3]; struct { T x, y, z; }; struct { T r, g, b; }; }; };
template <class T> struct pstore<T, 4> { union { T v[4]; struct { T x, y, z, w; }; struct { T r, g, b, a; }; }; };
template <class T, int N> struct packed_vec : pstore<T, N> {
  typedef T value_type;
  packed_vec() = default;
  packed_vec(const vec<T, N>& o) { for (int i = 0; i < N; ++i) this->v[i] = o.v[i]; }
  template <class A0, class... As,
            typename msl_detail::en<(sizeof...(As) > 0 || msl_detail::sk<A0>::v > 0), int>::type = 0>
  packed_vec(const A0& a0, const As&... as) : packed_vec(vec<T, N>(a0, as...)) {}
  vec<T, N> get() const { vec<T, N> r; for (int i = 0; i < N; ++i) r.v[i] = this->v[i]; return r; }
  operator vec<T, N>() const { return get(); }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }
  template <class B> packed_vec& operator+=(const B& b) { return *this = get() + b; }
  template <class B> packed_vec& operator-=(const B& b) { return *this = get() - b; }
  template <class B> packed_vec& operator*=(const B& b) { return *this = get() * b; }
  template <class B> packed_vec& operator/=(const B& b) { return *this = get() / b; }
};

namespace msl_detail {
// result of a binary vector operator: same lanes & element type, or vector op scalar
template <class A, class B, int na = vi<A>::n, int nb = vi<B>::n, class = void> struct bop {};
template <class A, class B, int n>
struct bop<A, B, n, n, typename en<(n > 0) && same<typename vi<A>::E, typename vi<B>::E>::v>::type> {
  typedef typename vi<A>::V V;
};
template <class A, class B, int n>
struct bop<A, B, n, 0, typename en<(n > 0) && (sk<B>::v > 0)>::type> { typedef typename vi<A>::V V; };
template <class A, class B, int n>
struct bop<A, B, 0, n, typename en<(n > 0) && (sk<A>::v > 0)>::type> { typedef typename vi<B>::V V; };

template <class V, class X> inline V vcast(const X& x) {
  if constexpr (vi<X>::n == 0) return V(typename V::value_type(x));
  else return tov(x);
}
}  // namespace msl_detail

#define MSL_VOP_(op)                                                                        \
  template <class A, class B>                                                               \
  inline typename msl_detail::bop<A, B>::V operator op(const A& a, const B& b) {            \
    typedef typename msl_detail::bop<A, B>::V V;                                            \
    typedef typename V::value_type E;                                                       \
    const V x = msl_detail::vcast<V>(a), y = msl_detail::vcast<V>(b);                       \
    V r;                                                                                    \
    for (int i = 0; i < int(msl_detail::vi<V>::n); ++i) r.v[i] = E(x.v[i] op y.v[i]);      \
    return r;                                                                               \
  }
MSL_VOP_(+) MSL_VOP_(-) MSL_VOP_(*) MSL_VOP_(/) MSL_VOP_(%) MSL_VOP_(&) MSL_VOP_(|) MSL_VOP_(^)
MSL_VOP_(<<) MSL_VOP_(>>)
#undef MSL_VOP_
#define MSL_VCMP_(op)                                                                       \
  template <class A, class B>                                                               \
  inline vec<bool, msl_detail::vi<typename msl_detail::bop<A, B>::V>::n> operator op(        \
      const A& a, const B& b) {                                                             \
    typedef typename msl_detail::bop<A, B>::V V;                                            \
    const V x = msl_detail::vcast<V>(a), y = msl_detail::vcast<V>(b);                       \
    vec<bool, msl_detail::vi<V>::n> r;                                                      \
    for (int i = 0; i < int(msl_detail::vi<V>::n); ++i) r.v[i] = bool(x.v[i] op y.v[i]);    \
    return r;                                                                               \
  }
MSL_VCMP_(==) MSL_VCMP_(!=) MSL_VCMP_(<) MSL_VCMP_(>) MSL_VCMP_(<=) MSL_VCMP_(>=)
MSL_VCMP_(&&) MSL_VCMP_(||)
#undef MSL_VCMP_
template <class A> inline typename msl_detail::vi<A>::V operator-(const A& a) {
  typename msl_detail::vi<A>::V r = msl_detail::tov(a);
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) r.v[i] = -r.v[i];
  return r;
}
template <class A> inline typename msl_detail::vi<A>::V operator+(const A& a) { return msl_detail::tov(a); }
template <class A> inline typename msl_detail::vi<A>::V operator~(const A& a) {
  typename msl_detail::vi<A>::V r = msl_detail::tov(a);
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) r.v[i] = ~r.v[i];
  return r;
}
template <class A>
inline typename msl_detail::en<(msl_detail::vi<A>::n > 0), vec<bool, msl_detail::vi<A>::n> >::type operator!(const A& a) {
  const typename msl_detail::vi<A>::V t = msl_detail::tov(a);
  vec<bool, msl_detail::vi<A>::n> r;
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) r.v[i] = !t.v[i];
  return r;
}

#define MSL_VT_(T, name)                                                            \
  typedef vec<T, 2> name##2; typedef vec<T, 3> name##3; typedef vec<T, 4> name##4;  \
  typedef packed_vec<T, 2> packed_##name##2; typedef packed_vec<T, 3> packed_##name##3; \
  typedef packed_vec<T, 4> packed_##name##4;
MSL_VT_(float, float) MSL_VT_(half, half) MSL_VT_(bfloat, bfloat) MSL_VT_(int, int)
MSL_VT_(uint, uint) MSL_VT_(short, short) MSL_VT_(ushort, ushort) MSL_VT_(char, char)
MSL_VT_(uchar, uchar) MSL_VT_(bool, bool) MSL_VT_(long, long) MSL_VT_(ulong, ulong)
#undef MSL_VT_

// ----------------------------------------------------------------- as_type
template <class T, class U> inline T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: source and destination sizes differ");
  T t;
  memcpy(static_cast<void*>(&t), static_cast<const void*>(&u), sizeof(T));
  return t;
}

// ----------------------------------------------------------------- math plumbing
namespace msl_detail {
// common scalar type of two scalars (Metal has no double: mixed fp -> float)
template <class A, class B, int ka = sk<A>::v, int kb = sk<B>::v> struct cs2 { typedef float type; };
template <class A, class B> struct cs2<A, B, 1, 1> { typedef decltype(A() + B()) type; };
template <class A, class B> struct cs2<A, B, 2, 1> { typedef A type; };
template <class A, class B> struct cs2<A, B, 1, 2> { typedef B type; };
template <class A, class B> struct cs { typedef typename cs2<A, B>::type type; };
template <class A> struct cs<A, A> { typedef A type; };

// validity of an argument list: all scalars / vector-likes, equal lane counts
template <class... X> struct okv { static constexpr int v = 1, n = 0; };
template <class X, class... R> struct okv<X, R...> {
  static constexpr int nx = vi<X>::n;
  static constexpr int n = nx ? nx : okv<R...>::n;
  static constexpr int v = (nx > 0 || sk<X>::v > 0) && okv<R...>::v && (nx == 0 || okv<R...>::n == 0 || nx == okv<R...>::n);
};
// element type: first vector argument's element, else the common scalar type
template <class... X> struct cmb;
template <class X> struct cmb<X> { typedef typename ai<X>::E E; static constexpr bool isv = vi<X>::n > 0; };
template <class X, class Y, class... R> struct cmb<X, Y, R...> {
  typedef cmb<Y, R...> T2;
  static constexpr bool isv = (vi<X>::n > 0) || T2::isv;
  typedef typename cond<(vi<X>::n > 0), typename ai<X>::E,
                        typename cond<T2::isv, typename T2::E,
                                      typename cs<typename ai<X>::E, typename T2::E>::type>::type>::type E;
};
template <class E, int n> struct shp { typedef vec<E, n> type; };
template <class E> struct shp<E, 0> { typedef E type; };
// float-function result element: half->half, bfloat->bfloat, everything else->float
template <class E> struct fres { typedef float type; };
template <> struct fres<half> { typedef half type; };
template <> struct fres<bfloat> { typedef bfloat type; };

template <bool ok, class... X> struct frt_ {};
template <class... X> struct frt_<true, X...> {
  typedef typename shp<typename fres<typename cmb<X...>::E>::type, okv<X...>::n>::type type;
};
template <class... X> struct frt : frt_<okv<X...>::v, X...> {};   // float math result
template <bool ok, class... X> struct grt_ {};
template <class... X> struct grt_<true, X...> {
  typedef typename shp<typename cmb<X...>::E, okv<X...>::n>::type type;
};
template <class... X> struct grt : grt_<okv<X...>::v, X...> {};   // type-preserving result
template <bool ok, class... X> struct brt_ {};
template <class... X> struct brt_<true, X...> { typedef typename shp<bool, okv<X...>::n>::type type; };
template <class... X> struct brt : brt_<okv<X...>::v, X...> {};   // predicate result

template <class E, class X> inline E ge(const X& x, int i) {
  if constexpr (vi<X>::n == 0) { (void)i; return E(x); }
  else return E(tov(x).v[i]);
}
template <class R> struct relem { typedef R E; };
template <class T, int N> struct relem<vec<T, N> > { typedef T E; };
// float-computed functions: args converted to float, result converted to R's element
template <class F, class R, class... X> inline R fap(const X&... x) {
  typedef typename relem<R>::E RE;
  if constexpr (vi<R>::n == 0) {
    return RE(F::f(float(x)...));
  } else {
    R r;
    for (int i = 0; i < int(vi<R>::n); ++i) r.v[i] = RE(F::f(ge<float>(x, i)...));
    return r;
  }
}
// type-preserving functions: args converted to the common element type E
template <class F, class R, class... X> inline R gap(const X&... x) {
  typedef typename relem<R>::E E;
  if constexpr (vi<R>::n == 0) {
    return F::template f<E>(E(x)...);
  } else {
    R r;
    for (int i = 0; i < int(vi<R>::n); ++i) r.v[i] = F::template f<E>(ge<E>(x, i)...);
    return r;
  }
}
template <class E> inline E fmn(E a, E b) {
  if constexpr (same<E, double>::v) return __builtin_fmin(a, b);
  else return E(__builtin_fminf(float(a), float(b)));
}
template <class E> inline E fmx(E a, E b) {
  if constexpr (same<E, double>::v) return __builtin_fmax(a, b);
  else return E(__builtin_fmaxf(float(a), float(b)));
}
template <class E> inline E imn(E a, E b) {
  if constexpr (sk<E>::v == 2) return fmn(a, b);
  else return b < a ? b : a;
}
template <class E> inline E imx(E a, E b) {
  if constexpr (sk<E>::v == 2) return fmx(a, b);
  else return a < b ? b : a;
}
constexpr inline bool fnan(float x) { return (f2u(x) & 0x7fffffffu) > 0x7f800000u; }
constexpr inline bool finf(float x) { return (f2u(x) & 0x7fffffffu) == 0x7f800000u; }
template <class E> struct ubits { typedef typename cond<sizeof(E) == 1, uint8_t,
  typename cond<sizeof(E) == 2, uint16_t, typename cond<sizeof(E) == 4, uint32_t, uint64_t>::type>::type>::type type; };
}  // namespace msl_detail

// ---- float-computed unary / binary / ternary functions
#define MSL_F1_(name, expr)                                                                  \
  namespace msl_detail { struct F_##name { static inline float f(float x) { return expr; } }; } \
  template <class X> inline typename msl_detail::frt<X>::type name(const X& x) {             \
    return msl_detail::fap<msl_detail::F_##name, typename msl_detail::frt<X>::type>(x);       \
  }
#define MSL_F2_(name, expr)                                                                  \
  namespace msl_detail { struct F_##name { static inline float f(float x, float y) { return expr; } }; } \
  template <class X, class Y> inline typename msl_detail::frt<X, Y>::type name(const X& x, const Y& y) { \
    return msl_detail::fap<msl_detail::F_##name, typename msl_detail::frt<X, Y>::type>(x, y);  \
  }
#define MSL_F3_(name, expr)                                                                  \
  namespace msl_detail { struct F_##name { static inline float f(float x, float y, float z) { return expr; } }; } \
  template <class X, class Y, class Z>                                                       \
  inline typename msl_detail::frt<X, Y, Z>::type name(const X& x, const Y& y, const Z& z) {  \
    return msl_detail::fap<msl_detail::F_##name, typename msl_detail::frt<X, Y, Z>::type>(x, y, z); \
  }
#define MSL_B1_(name, expr)                                                                  \
  namespace msl_detail { struct B_##name { static inline bool f(float x) { return expr; } }; } \
  template <class X> inline typename msl_detail::brt<X>::type name(const X& x) {             \
    return msl_detail::fap<msl_detail::B_##name, typename msl_detail::brt<X>::type>(x);       \
  }
#define MSL_B2_(name, expr)                                                                  \
  namespace msl_detail { struct B_##name { static inline bool f(float x, float y) { return expr; } }; } \
  template <class X, class Y> inline typename msl_detail::brt<X, Y>::type name(const X& x, const Y& y) { \
    return msl_detail::fap<msl_detail::B_##name, typename msl_detail::brt<X, Y>::type>(x, y);  \
  }
#define MSL_G_(name, nargs_params, nargs_args, tparams, targs, body)                         \
  namespace msl_detail { struct G_##name { template <class E> static inline E f nargs_params { body } }; } \
  template <tparams> inline typename msl_detail::grt<targs>::type name nargs_params##_ {    \
    return msl_detail::gap<msl_detail::G_##name, typename msl_detail::grt<targs>::type> nargs_args; \
  }

MSL_F1_(sqrt, __builtin_sqrtf(x))
MSL_F1_(rsqrt, 1.0f / __builtin_sqrtf(x))
MSL_F1_(exp, __builtin_expf(x))
MSL_F1_(exp2, __builtin_exp2f(x))
MSL_F1_(exp10, __builtin_powf(10.0f, x))
MSL_F1_(log, __builtin_logf(x))
MSL_F1_(log2, __builtin_log2f(x))
MSL_F1_(log10, __builtin_log10f(x))
MSL_F1_(sin, __builtin_sinf(x))
MSL_F1_(cos, __builtin_cosf(x))
MSL_F1_(tan, __builtin_tanf(x))
MSL_F1_(asin, __builtin_asinf(x))
MSL_F1_(acos, __builtin_acosf(x))
MSL_F1_(atan, __builtin_atanf(x))
MSL_F1_(sinh, __builtin_sinhf(x))
MSL_F1_(cosh, __builtin_coshf(x))
MSL_F1_(tanh, __builtin_tanhf(x))
MSL_F1_(asinh, __builtin_asinhf(x))
MSL_F1_(acosh, __builtin_acoshf(x))
MSL_F1_(atanh, __builtin_atanhf(x))
MSL_F1_(sinpi, float(__builtin_sin(3.14159265358979323846 * double(x))))
MSL_F1_(cospi, float(__builtin_cos(3.14159265358979323846 * double(x))))
MSL_F1_(tanpi, float(__builtin_tan(3.14159265358979323846 * double(x))))
MSL_F1_(floor, __builtin_floorf(x))
MSL_F1_(ceil, __builtin_ceilf(x))
MSL_F1_(round, __builtin_roundf(x))
MSL_F1_(rint, __builtin_rintf(x))
MSL_F1_(trunc, __builtin_truncf(x))
MSL_F1_(fract, __builtin_fminf(x - __builtin_floorf(x), 0x1.fffffep-1f))
MSL_F1_(fabs, __builtin_fabsf(x))
MSL_F1_(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (msl_detail::fnan(x) ? 0.0f : x)))
MSL_F1_(saturate, __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f))
MSL_F2_(pow, __builtin_powf(x, y))
MSL_F2_(powr, __builtin_powf(x, y))
MSL_F2_(atan2, __builtin_atan2f(x, y))
MSL_F2_(fmod, __builtin_fmodf(x, y))
MSL_F2_(copysign, __builtin_copysignf(x, y))
MSL_F2_(fdim, __builtin_fdimf(x, y))
MSL_F2_(fmin, __builtin_fminf(x, y))
MSL_F2_(fmax, __builtin_fmaxf(x, y))
MSL_F2_(step, y < x ? 0.0f : 1.0f)
MSL_F2_(divide, x / y)
MSL_F2_(nextafter, __builtin_nextafterf(x, y))
MSL_F3_(fma, __builtin_fmaf(x, y, z))
MSL_F3_(mad, x * y + z)
MSL_F3_(mix, x + (y - x) * z)
MSL_F3_(smoothstep, ([](float e0, float e1, float v) {
          float t = __builtin_fminf(__builtin_fmaxf((v - e0) / (e1 - e0), 0.0f), 1.0f);
          return t * t * (3.0f - 2.0f * t); })(x, y, z))
MSL_F3_(fmin3, __builtin_fminf(__builtin_fminf(x, y), z))
MSL_F3_(fmax3, __builtin_fmaxf(__builtin_fmaxf(x, y), z))
MSL_F3_(fmedian3, __builtin_fmaxf(__builtin_fminf(x, y), __builtin_fminf(__builtin_fmaxf(x, y), z)))
// predicates use bit tests, so they also work under -ffast-math
MSL_B1_(isnan, msl_detail::fnan(x))
MSL_B1_(isinf, msl_detail::finf(x))
MSL_B1_(isfinite, (msl_detail::f2u(x) & 0x7f800000u) != 0x7f800000u)
MSL_B1_(isnormal, ((msl_detail::f2u(x) & 0x7f800000u) != 0x7f800000u) && ((msl_detail::f2u(x) & 0x7f800000u) != 0u))
MSL_B1_(signbit, (msl_detail::f2u(x) >> 31) != 0u)
MSL_B2_(isordered, !msl_detail::fnan(x) && !msl_detail::fnan(y))
MSL_B2_(isunordered, msl_detail::fnan(x) || msl_detail::fnan(y))

// ---- type-preserving functions (integers stay integers)
#define MSL_P1_ (E a)
#define MSL_P1__ (const X& a)
#define MSL_P2_ (E a, E b)
#define MSL_P2__ (const X& a, const Y& b)
#define MSL_P3_ (E a, E b, E c)
#define MSL_P3__ (const X& a, const Y& b, const Z& c)
#define MSL_COMMA_ ,
MSL_G_(abs, MSL_P1_, (a), class X, X,
       if constexpr (msl_detail::sk<E>::v == 2) return E(__builtin_fabsf(float(a)));
       else if constexpr (E(-1) < E(0)) return a < E(0) ? E(0ull - (unsigned long long)a) : a;
       else return a;)
MSL_G_(min, MSL_P2_, (a, b), class X MSL_COMMA_ class Y, X MSL_COMMA_ Y, return msl_detail::imn(a, b);)
MSL_G_(max, MSL_P2_, (a, b), class X MSL_COMMA_ class Y, X MSL_COMMA_ Y, return msl_detail::imx(a, b);)
MSL_G_(clamp, MSL_P3_, (a, b, c), class X MSL_COMMA_ class Y MSL_COMMA_ class Z, X MSL_COMMA_ Y MSL_COMMA_ Z,
       return msl_detail::imn(msl_detail::imx(a, b), c);)
MSL_G_(min3, MSL_P3_, (a, b, c), class X MSL_COMMA_ class Y MSL_COMMA_ class Z, X MSL_COMMA_ Y MSL_COMMA_ Z,
       return msl_detail::imn(msl_detail::imn(a, b), c);)
MSL_G_(max3, MSL_P3_, (a, b, c), class X MSL_COMMA_ class Y MSL_COMMA_ class Z, X MSL_COMMA_ Y MSL_COMMA_ Z,
       return msl_detail::imx(msl_detail::imx(a, b), c);)
MSL_G_(median3, MSL_P3_, (a, b, c), class X MSL_COMMA_ class Y MSL_COMMA_ class Z, X MSL_COMMA_ Y MSL_COMMA_ Z,
       return msl_detail::imx(msl_detail::imn(a, b), msl_detail::imn(msl_detail::imx(a, b), c));)
// integer bit functions (result has the argument's type)
MSL_G_(popcount, MSL_P1_, (a), class X, X,
       return E(__builtin_popcountll((unsigned long long)(typename msl_detail::ubits<E>::type)a));)
MSL_G_(clz, MSL_P1_, (a), class X, X,
       typedef typename msl_detail::ubits<E>::type U; const U u = U(a);
       return u == 0 ? E(8 * sizeof(E)) : E(__builtin_clzll((unsigned long long)u) - (64 - 8 * int(sizeof(E))));)
MSL_G_(ctz, MSL_P1_, (a), class X, X,
       typedef typename msl_detail::ubits<E>::type U; const U u = U(a);
       return u == 0 ? E(8 * sizeof(E)) : E(__builtin_ctzll((unsigned long long)u));)
MSL_G_(mulhi, MSL_P2_, (a, b), class X MSL_COMMA_ class Y, X MSL_COMMA_ Y,
       if constexpr (sizeof(E) == 8) {
         if constexpr (E(-1) < E(0)) return E(((__int128)a * (__int128)b) >> 64);
         else return E(((unsigned __int128)a * (unsigned __int128)b) >> 64);
       } else {
         return E(((long long)a * (long long)b) >> (8 * sizeof(E)));
       })
#undef MSL_P1_
#undef MSL_P1__
#undef MSL_P2_
#undef MSL_P2__
#undef MSL_P3_
#undef MSL_P3__
#undef MSL_COMMA_
#undef MSL_F1_
#undef MSL_F2_
#undef MSL_F3_
#undef MSL_B1_
#undef MSL_B2_
#undef MSL_G_

// select(a, b, c): c ? b : a, lane-wise (c: bool or bool vector)
template <class A, class B, class C>
inline typename msl_detail::en<msl_detail::okv<A, B, C>::v, typename msl_detail::grt<A, B>::type>::type
select(const A& a, const B& b, const C& c) {
  typedef typename msl_detail::grt<A, B>::type R;
  typedef typename msl_detail::relem<R>::E E;
  if constexpr (msl_detail::vi<R>::n == 0) {
    return bool(c) ? E(b) : E(a);
  } else {
    R r;
    for (int i = 0; i < int(msl_detail::vi<R>::n); ++i)
      r.v[i] = msl_detail::ge<bool>(c, i) ? msl_detail::ge<E>(b, i) : msl_detail::ge<E>(a, i);
    return r;
  }
}
template <class X> inline typename msl_detail::en<msl_detail::okv<X>::v, bool>::type all(const X& x) {
  if constexpr (msl_detail::vi<X>::n == 0) return bool(x);
  else { for (int i = 0; i < int(msl_detail::vi<X>::n); ++i) if (!msl_detail::ge<bool>(x, i)) return false; return true; }
}
template <class X> inline typename msl_detail::en<msl_detail::okv<X>::v, bool>::type any(const X& x) {
  if constexpr (msl_detail::vi<X>::n == 0) return bool(x);
  else { for (int i = 0; i < int(msl_detail::vi<X>::n); ++i) if (msl_detail::ge<bool>(x, i)) return true; return false; }
}

// ---- geometric (float accumulation, result rounded to the element type)
namespace msl_detail {
template <class A, class B> struct geo2 {};
template <class A, class B, bool ok> struct geo2_ {};
template <class A, class B> struct geo2_<A, B, true> {
  typedef typename fres<typename vi<A>::E>::type S;   // scalar result
  typedef vec<S, vi<A>::n> V;                          // vector result
};
template <class A, class B> struct geo
    : geo2_<A, B, (vi<A>::n > 0) && int(vi<A>::n) == int(vi<B>::n)> {};
template <class A> struct geo1 : geo2_<A, A, (vi<A>::n > 0)> {};
template <class A, class B> inline float dotf(const A& a, const B& b) {
  const auto& x = tov(a);
  const auto& y = tov(b);
  float s = 0.0f;
  for (int i = 0; i < int(vi<A>::n); ++i) s += float(x.v[i]) * float(y.v[i]);
  return s;
}
}  // namespace msl_detail
template <class A, class B> inline typename msl_detail::geo<A, B>::S dot(const A& a, const B& b) {
  return typename msl_detail::geo<A, B>::S(msl_detail::dotf(a, b));
}
template <class A> inline typename msl_detail::geo1<A>::S length_squared(const A& a) {
  return typename msl_detail::geo1<A>::S(msl_detail::dotf(a, a));
}
template <class A> inline typename msl_detail::geo1<A>::S length(const A& a) {
  return typename msl_detail::geo1<A>::S(__builtin_sqrtf(msl_detail::dotf(a, a)));
}
template <class A, class B> inline typename msl_detail::geo<A, B>::S distance_squared(const A& a, const B& b) {
  const auto& x = msl_detail::tov(a); const auto& y = msl_detail::tov(b);
  float s = 0.0f;
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) { float d = float(x.v[i]) - float(y.v[i]); s += d * d; }
  return typename msl_detail::geo<A, B>::S(s);
}
template <class A, class B> inline typename msl_detail::geo<A, B>::S distance(const A& a, const B& b) {
  const auto& x = msl_detail::tov(a); const auto& y = msl_detail::tov(b);
  float s = 0.0f;
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) { float d = float(x.v[i]) - float(y.v[i]); s += d * d; }
  return typename msl_detail::geo<A, B>::S(__builtin_sqrtf(s));
}
template <class A> inline typename msl_detail::geo1<A>::V normalize(const A& a) {
  const auto& x = msl_detail::tov(a);
  const float k = 1.0f / __builtin_sqrtf(msl_detail::dotf(a, a));
  typename msl_detail::geo1<A>::V r;
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) r.v[i] = float(x.v[i]) * k;
  return r;
}
template <class A, class B>
inline typename msl_detail::en<msl_detail::vi<A>::n == 3, typename msl_detail::geo<A, B>::V>::type
cross(const A& a, const B& b) {
  const auto& x = msl_detail::tov(a); const auto& y = msl_detail::tov(b);
  const float x0 = float(x.v[0]), x1 = float(x.v[1]), x2 = float(x.v[2]);
  const float y0 = float(y.v[0]), y1 = float(y.v[1]), y2 = float(y.v[2]);
  return typename msl_detail::geo<A, B>::V(x1 * y2 - x2 * y1, x2 * y0 - x0 * y2, x0 * y1 - x1 * y0);
}

// ---- functions with an output argument (`thread T&` in Metal)
template <class X> inline typename msl_detail::frt<X>::type sincos(const X& x, typename msl_detail::frt<X>::type& c) {
  c = cos(x);
  return sin(x);
}
namespace msl_detail {
struct F_modfrac {
  static inline float f(float x) { return finf(x) ? __builtin_copysignf(0.0f, x) : __builtin_copysignf(x - __builtin_truncf(x), x); }
};
}  // namespace msl_detail
template <class X> inline typename msl_detail::frt<X>::type modf(const X& x, typename msl_detail::frt<X>::type& ip) {
  ip = trunc(x);
  return msl_detail::fap<msl_detail::F_modfrac, typename msl_detail::frt<X>::type>(x);
}
template <class X, class K>
inline typename msl_detail::en<msl_detail::okv<X, K>::v, typename msl_detail::frt<X>::type>::type
ldexp(const X& x, const K& k) {
  typedef typename msl_detail::frt<X>::type R;
  if constexpr (msl_detail::vi<R>::n == 0) return R(__builtin_ldexpf(float(x), int(k)));
  else {
    R r;
    for (int i = 0; i < int(msl_detail::vi<R>::n); ++i)
      r.v[i] = __builtin_ldexpf(msl_detail::ge<float>(x, i), msl_detail::ge<int>(k, i));
    return r;
  }
}
template <class X>
inline typename msl_detail::frt<X>::type frexp(const X& x, typename msl_detail::shp<int, msl_detail::okv<X>::n>::type& e) {
  typedef typename msl_detail::frt<X>::type R;
  if constexpr (msl_detail::vi<R>::n == 0) return R(__builtin_frexpf(float(x), &e));
  else {
    R r;
    for (int i = 0; i < int(msl_detail::vi<R>::n); ++i) r.v[i] = __builtin_frexpf(msl_detail::ge<float>(x, i), &e.v[i]);
    return r;
  }
}

// Same implementations under metal::precise:: and metal::fast::
#define MSL_NS_USING_                                                                        \
  using metal::sqrt; using metal::rsqrt; using metal::exp; using metal::exp2; using metal::exp10; \
  using metal::log; using metal::log2; using metal::log10; using metal::sin; using metal::cos;    \
  using metal::tan; using metal::asin; using metal::acos; using metal::atan; using metal::sinh;  \
  using metal::cosh; using metal::tanh; using metal::asinh; using metal::acosh; using metal::atanh; \
  using metal::sinpi; using metal::cospi; using metal::tanpi; using metal::floor; using metal::ceil; \
  using metal::round; using metal::rint; using metal::trunc; using metal::fract; using metal::fabs; \
  using metal::sign; using metal::saturate; using metal::pow; using metal::powr; using metal::atan2; \
  using metal::fmod; using metal::copysign; using metal::fdim; using metal::fmin; using metal::fmax; \
  using metal::step; using metal::divide; using metal::nextafter; using metal::fma; using metal::mad; \
  using metal::mix; using metal::smoothstep; using metal::fmin3; using metal::fmax3;             \
  using metal::fmedian3; using metal::abs; using metal::min; using metal::max; using metal::clamp; \
  using metal::sincos; using metal::modf; using metal::ldexp; using metal::frexp; using metal::dot; \
  using metal::length; using metal::length_squared; using metal::distance;                      \
  using metal::distance_squared; using metal::normalize; using metal::cross;                    \
  using metal::isnan; using metal::isinf; using metal::isfinite; using metal::signbit;
namespace precise { MSL_NS_USING_ }
namespace fast { MSL_NS_USING_ }
#undef MSL_NS_USING_

// ----------------------------------------------------------------- numeric_limits
template <class T> struct numeric_limits {
  static constexpr bool is_specialized = false;
};
template <> struct numeric_limits<float> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true;
  static constexpr int digits = 24, max_exponent = 128, min_exponent = -125, radix = 2;
  static constexpr float min() { return msl_detail::u2f(0x00800000u); }
  static constexpr float max() { return msl_detail::u2f(0x7f7fffffu); }
  static constexpr float lowest() { return msl_detail::u2f(0xff7fffffu); }
  static constexpr float epsilon() { return msl_detail::u2f(0x34000000u); }
  static constexpr float round_error() { return 0.5f; }
  static constexpr float infinity() { return msl_detail::u2f(0x7f800000u); }
  static constexpr float quiet_NaN() { return msl_detail::u2f(0x7fc00000u); }
  static constexpr float signaling_NaN() { return msl_detail::u2f(0x7fa00000u); }
  static constexpr float denorm_min() { return msl_detail::u2f(0x00000001u); }
};
namespace msl_detail {
constexpr inline half h16(uint16_t b) { return __builtin_bit_cast(half, b); }
}
template <> struct numeric_limits<half> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true;
  static constexpr int digits = 11, max_exponent = 16, min_exponent = -13, radix = 2;
  static constexpr half min() { return msl_detail::h16(0x0400); }
  static constexpr half max() { return msl_detail::h16(0x7bff); }
  static constexpr half lowest() { return msl_detail::h16(0xfbff); }
  static constexpr half epsilon() { return msl_detail::h16(0x1400); }
  static constexpr half round_error() { return msl_detail::h16(0x3800); }
  static constexpr half infinity() { return msl_detail::h16(0x7c00); }
  static constexpr half quiet_NaN() { return msl_detail::h16(0x7e00); }
  static constexpr half signaling_NaN() { return msl_detail::h16(0x7d00); }
  static constexpr half denorm_min() { return msl_detail::h16(0x0001); }
};
template <> struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false;
  static constexpr bool has_infinity = true, has_quiet_NaN = true;
  static constexpr int digits = 8, max_exponent = 128, min_exponent = -125, radix = 2;
  static constexpr bfloat min() { return bfloat::from_bits(0x0080); }
  static constexpr bfloat max() { return bfloat::from_bits(0x7f7f); }
  static constexpr bfloat lowest() { return bfloat::from_bits(0xff7f); }
  static constexpr bfloat epsilon() { return bfloat::from_bits(0x3c00); }
  static constexpr bfloat round_error() { return bfloat::from_bits(0x3f00); }
  static constexpr bfloat infinity() { return bfloat::from_bits(0x7f80); }
  static constexpr bfloat quiet_NaN() { return bfloat::from_bits(0x7fc0); }
  static constexpr bfloat signaling_NaN() { return bfloat::from_bits(0x7fa0); }
  static constexpr bfloat denorm_min() { return bfloat::from_bits(0x0001); }
};
namespace msl_detail {
template <class T> struct ilim {
  static constexpr bool is_specialized = true, is_signed = T(-1) < T(0), is_integer = true, is_exact = true;
  static constexpr bool has_infinity = false, has_quiet_NaN = false;
  static constexpr int digits = int(8 * sizeof(T)) - (is_signed ? 1 : 0), radix = 2;
  static constexpr T max() {
    return is_signed ? T((1ull << (8 * sizeof(T) - 1)) - 1ull) : T(~0ull);
  }
  static constexpr T min() { return is_signed ? T(-max() - 1) : T(0); }
  static constexpr T lowest() { return min(); }
  static constexpr T epsilon() { return T(0); }
  static constexpr T round_error() { return T(0); }
  static constexpr T infinity() { return T(0); }
  static constexpr T quiet_NaN() { return T(0); }
  static constexpr T signaling_NaN() { return T(0); }
  static constexpr T denorm_min() { return T(0); }
};
}  // namespace msl_detail
template <> struct numeric_limits<char> : msl_detail::ilim<char> {};
template <> struct numeric_limits<signed char> : msl_detail::ilim<signed char> {};
template <> struct numeric_limits<unsigned char> : msl_detail::ilim<unsigned char> {};
template <> struct numeric_limits<short> : msl_detail::ilim<short> {};
template <> struct numeric_limits<unsigned short> : msl_detail::ilim<unsigned short> {};
template <> struct numeric_limits<int> : msl_detail::ilim<int> {};
template <> struct numeric_limits<unsigned> : msl_detail::ilim<unsigned> {};
template <> struct numeric_limits<long> : msl_detail::ilim<long> {};
template <> struct numeric_limits<unsigned long> : msl_detail::ilim<unsigned long> {};
template <> struct numeric_limits<long long> : msl_detail::ilim<long long> {};
template <> struct numeric_limits<unsigned long long> : msl_detail::ilim<unsigned long long> {};
template <> struct numeric_limits<bool> {
  static constexpr bool is_specialized = true, is_signed = false, is_integer = true, is_exact = true;
  static constexpr int digits = 1;
  static constexpr bool min() { return false; }
  static constexpr bool max() { return true; }
  static constexpr bool lowest() { return false; }
};

// ----------------------------------------------------------------- atomics
// Real hardware atomics (several OS threads may run threadgroups at once).
// The memory_order argument is accepted but every operation is seq_cst
// (stronger than Metal's relaxed).  atomic<T> is layout-identical to T.
enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst
};
template <class T> struct atomic {
  T msl_value_;
  atomic() = default;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<long> atomic_long;
typedef atomic<ulong> atomic_ulong;

namespace msl_detail {
template <class T> inline T* ap(volatile atomic<T>* o) { return const_cast<T*>(&o->msl_value_); }
template <class T> struct abits { typedef typename ubits<T>::type type; };
// generic read-modify-write via compare-exchange on the bit pattern
template <class T, class F> inline T rmw(volatile atomic<T>* o, F fn) {
  typedef typename abits<T>::type U;
  U* p = reinterpret_cast<U*>(ap(o));
  U old = __atomic_load_n(p, __ATOMIC_RELAXED);
  for (;;) {
    T ov, nv;
    memcpy(&ov, &old, sizeof(T));
    nv = fn(ov);
    U nu;
    memcpy(&nu, &nv, sizeof(T));
    if (__atomic_compare_exchange_n(p, &old, nu, true, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) return ov;
  }
}
template <class T> struct fadd { T v; T operator()(T a) const { return T(a + v); } };
template <class T> struct fsub { T v; T operator()(T a) const { return T(a - v); } };
template <class T> struct fmin_ { T v; T operator()(T a) const { return imn(a, v); } };
template <class T> struct fmax_ { T v; T operator()(T a) const { return imx(a, v); } };
}  // namespace msl_detail

template <class T>
inline void atomic_store_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  __atomic_store(msl_detail::ap(o), &v, __ATOMIC_SEQ_CST);
}
template <class T> inline T atomic_load_explicit(volatile atomic<T>* o, memory_order = memory_order_relaxed) {
  T r;
  __atomic_load(msl_detail::ap(o), &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class T>
inline T atomic_exchange_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  T r;
  __atomic_exchange(msl_detail::ap(o), &v, &r, __ATOMIC_SEQ_CST);
  return r;
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type* expected,
                                                  typename msl_detail::idt<T>::type desired,
                                                  memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  // strong CAS: a spurious failure is allowed by "weak" but never needed
  return __atomic_compare_exchange(msl_detail::ap(o), expected, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomic_fetch_add_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  if constexpr (msl_detail::sk<T>::v == 1) return __atomic_fetch_add(msl_detail::ap(o), v, __ATOMIC_SEQ_CST);
  else return msl_detail::rmw(o, msl_detail::fadd<T>{v});
}
template <class T>
inline T atomic_fetch_sub_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  if constexpr (msl_detail::sk<T>::v == 1) return __atomic_fetch_sub(msl_detail::ap(o), v, __ATOMIC_SEQ_CST);
  else return msl_detail::rmw(o, msl_detail::fsub<T>{v});
}
template <class T>
inline T atomic_fetch_min_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  return msl_detail::rmw(o, msl_detail::fmin_<T>{v});
}
template <class T>
inline T atomic_fetch_max_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  return msl_detail::rmw(o, msl_detail::fmax_<T>{v});
}
template <class T>
inline T atomic_fetch_and_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  return __atomic_fetch_and(msl_detail::ap(o), v, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomic_fetch_or_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  return __atomic_fetch_or(msl_detail::ap(o), v, __ATOMIC_SEQ_CST);
}
template <class T>
inline T atomic_fetch_xor_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v, memory_order = memory_order_relaxed) {
  return __atomic_fetch_xor(msl_detail::ap(o), v, __ATOMIC_SEQ_CST);
}
}  // namespace metal

using namespace metal;
typedef half float16_t;
typedef metal::bfloat bfloat16_t;

// ----------------------------------------------------------------- constants
#ifndef METAL_FUNC
#define METAL_FUNC inline __attribute__((always_inline))
#endif
#ifndef INFINITY
#define INFINITY (__builtin_inff ())
#endif
#ifndef NAN
#define NAN (__builtin_nanf (""))
#endif
#ifndef HUGE_VALF
#define HUGE_VALF (__builtin_huge_valf ())
#endif
#ifndef MAXFLOAT
#define MAXFLOAT 3.40282347e+38F
#endif
#ifndef FLT_MAX
#define FLT_MAX __FLT_MAX__
#endif
#ifndef FLT_MIN
#define FLT_MIN __FLT_MIN__
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON __FLT_EPSILON__
#endif
#ifndef HALF_MAX
#define HALF_MAX (metal::numeric_limits<half>::max())
#define HALF_MIN (metal::numeric_limits<half>::min())
#define HALF_EPSILON (metal::numeric_limits<half>::epsilon())
#endif
#ifndef M_PI_F
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f
#define M_E_H ((half)M_E_F)
#define M_LOG2E_H ((half)M_LOG2E_F)
#define M_LN2_H ((half)M_LN2_F)
#define M_PI_H ((half)M_PI_F)
#define M_SQRT2_H ((half)M_SQRT2_F)
#endif

// ----------------------------------------------------------------- address spaces
#ifndef MSL_NO_ADDRESS_SPACE_MACROS
#define device
#define constant
#define thread
#define threadgroup
#define ray_data
#define object_data
#endif

#endif  // XLSTM_EMULATE_MSL_TYPES_H
