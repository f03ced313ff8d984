// compat.h -- the Metal Shading Language subset of metal_src/ for CUDA device code.
//
// xlstm_kernels.cuda.kernel passes this text (after `#define XK_MAX_THREADS n`) as the
// `header` of mx.fast.cuda_kernel, so it follows MLX's prelude (utils.cuh: <cuda_fp16.h>,
// <cuda_bf16.h>, cuda::std) and precedes the family header (wrapped in the same
// namespace) and the generated __global__ function. Compiled by NVRTC with
// --device-as-default-execution-space: plain functions here are device functions.
//
// Everything lives in namespace mlx::core::cu, where the kernel body is compiled, so
// its names (float4, uint3, min, fma, ...) hide CUDA's global ones inside the body:
//  scalars   uint ushort uchar ulong; half = __half, bfloat = __nv_bfloat16 (+ float16_t,
//            bfloat16_t); half/bfloat op float -> float, op integer -> half/bfloat.
//  vectors   vec<T,N> (N = 2,3,4) with Metal layout (vec<T,3> is 4 elements wide),
//            <type><N> / packed_<type><N> typedefs, .xyzw/.rgba, [i], swizzles,
//            splat / piecewise / converting constructors, lane-wise operators.
//  math      metal::, metal::precise:: (CUDA's accurate functions) and metal::fast::
//            (CUDA intrinsics where they meet Metal's fast-math accuracy); half/bfloat
//            computed in float and rounded; lane-wise on vectors. Unqualified calls
//            (fma, min, max, dot, ...) resolve here too.
//  sync      threadgroup_barrier -> __syncthreads, simdgroup_barrier -> __syncwarp.
//  simd      simd_* / quad_* reductions, scans, shuffles, broadcasts and votes over the
//            lanes that call them (__activemask()): butterflies when the whole warp is
//            active, an ordered gather over the active lanes when it is not, so
//            `if (lane < 8) x = simd_sum(v);` gives Metal's answer. Reductions and scans
//            of half/bfloat accumulate in float.
//  matrix    simdgroup_matrix<T, 8, 8> in the tensor cores' accumulator layout (lane
//            4g + t holds row g, columns 2t and 2t + 1; xk_frag_coord says so to bodies):
//            simdgroup_load / store (each lane its own two elements) and
//            simdgroup_multiply(_accumulate): half x half and bfloat x bfloat on tensor
//            cores (mma.m16n8k8; paired helpers xk_mma2 / xk_mma2_k16 use all 16 rows of
//            m16n8k8 / m16n8k16; float accumulate; sm_80+), float products in float32
//            through warp shuffles.
//  atomics   atomic<T> (layout of T), atomic_*_explicit (relaxed: CUDA's atomics).
//  misc      address-space keywords are empty macros (`threadgroup` declarations are
//            rewritten to __shared__ by the factory), INFINITY / FLT_MAX / M_*_F,
//            as_type, select, MLX's Metal prelude helpers (ceildiv, elem_to_loc on the
//            Shape / Strides arrays cuda_kernel passes).
#ifndef XLSTM_CUDA_COMPAT_H
#define XLSTM_CUDA_COMPAT_H

#ifndef XK_MAX_THREADS
#define XK_MAX_THREADS 1024
#endif

// ----------------------------------------------------------------- address spaces
#define device
#define constant
#define thread
#define threadgroup
#define ray_data
#define object_data
#ifndef METAL_FUNC
#define METAL_FUNC inline
#endif

// ----------------------------------------------------------------- constants
#ifndef INFINITY
#define INFINITY (__int_as_float(0x7f800000))
#endif
#ifndef NAN
#define NAN (__int_as_float(0x7fffffff))
#endif
#ifndef HUGE_VALF
#define HUGE_VALF INFINITY
#endif
#ifndef MAXFLOAT
#define MAXFLOAT 3.40282347e+38F
#endif
#ifndef FLT_MAX
#define FLT_MAX 3.40282347e+38F
#endif
#ifndef FLT_MIN
#define FLT_MIN 1.17549435e-38F
#endif
#ifndef FLT_EPSILON
#define FLT_EPSILON 1.19209290e-07F
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
#endif

namespace mlx::core::cu {

// ----------------------------------------------------------------- scalars
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef ::__half half;
typedef ::__nv_bfloat16 bfloat;
typedef ::__half float16_t;
typedef ::__nv_bfloat16 bfloat16_t;

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
template <class T> struct sk<const T> : sk<T> {};
#define XK_SK_(T, k) template <> struct sk<T> { static constexpr int v = k; };
XK_SK_(bool, 1) XK_SK_(char, 1) XK_SK_(signed char, 1) XK_SK_(unsigned char, 1)
XK_SK_(short, 1) XK_SK_(unsigned short, 1) XK_SK_(int, 1) XK_SK_(unsigned, 1)
XK_SK_(long, 1) XK_SK_(unsigned long, 1) XK_SK_(long long, 1) XK_SK_(unsigned long long, 1)
XK_SK_(float, 2) XK_SK_(double, 2) XK_SK_(::__half, 2) XK_SK_(::__nv_bfloat16, 2)
#undef XK_SK_
// half or bfloat
template <class T> struct lowp { static constexpr int v = 0; };
template <> struct lowp<::__half> { static constexpr int v = 1; };
template <> struct lowp<::__nv_bfloat16> { static constexpr int v = 1; };

inline uint f2u(float f) { return __float_as_uint(f); }
inline bool fnan(float x) { return (f2u(x) & 0x7fffffffu) > 0x7f800000u; }
inline bool finf(float x) { return (f2u(x) & 0x7fffffffu) == 0x7f800000u; }
// memcpy for device code (NVRTC has no builtin one)
inline void bytecopy(void* d, const void* s, int n) {
  unsigned char* dd = static_cast<unsigned char*>(d);
  const unsigned char* ss = static_cast<const unsigned char*>(s);
  for (int i = 0; i < n; ++i) dd[i] = ss[i];
}
}  // namespace msl_detail

// ----------------------------------------------------------------- half / bfloat mixed with float
// Metal: half op float -> float; half op integer -> half (likewise bfloat). CUDA's own
// half x half operators (global, found by ADL) handle the same-type case.
#define XK_LP_OPS_(L)                                                                            \
  inline float operator+(L a, float b) { return float(a) + b; }                                  \
  inline float operator-(L a, float b) { return float(a) - b; }                                  \
  inline float operator*(L a, float b) { return float(a) * b; }                                  \
  inline float operator/(L a, float b) { return float(a) / b; }                                  \
  inline float operator+(float a, L b) { return a + float(b); }                                  \
  inline float operator-(float a, L b) { return a - float(b); }                                  \
  inline float operator*(float a, L b) { return a * float(b); }                                  \
  inline float operator/(float a, L b) { return a / float(b); }                                  \
  inline bool operator<(L a, float b) { return float(a) < b; }                                   \
  inline bool operator>(L a, float b) { return float(a) > b; }                                   \
  inline bool operator<=(L a, float b) { return float(a) <= b; }                                 \
  inline bool operator>=(L a, float b) { return float(a) >= b; }                                 \
  inline bool operator==(L a, float b) { return float(a) == b; }                                 \
  inline bool operator!=(L a, float b) { return float(a) != b; }                                 \
  inline bool operator<(float a, L b) { return a < float(b); }                                   \
  inline bool operator>(float a, L b) { return a > float(b); }                                   \
  inline bool operator<=(float a, L b) { return a <= float(b); }                                 \
  inline bool operator>=(float a, L b) { return a >= float(b); }                                 \
  inline bool operator==(float a, L b) { return a == float(b); }                                 \
  inline bool operator!=(float a, L b) { return a != float(b); }                                 \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator+(L a, S b) { return L(float(a) + float(b)); }                                \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator-(L a, S b) { return L(float(a) - float(b)); }                                \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator*(L a, S b) { return L(float(a) * float(b)); }                                \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator/(L a, S b) { return L(float(a) / float(b)); }                                \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator+(S a, L b) { return L(float(a) + float(b)); }                                \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator-(S a, L b) { return L(float(a) - float(b)); }                                \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator*(S a, L b) { return L(float(a) * float(b)); }                                \
  template <class S, typename msl_detail::en<msl_detail::sk<S>::v == 1, int>::type = 0>           \
  inline L operator/(S a, L b) { return L(float(a) / float(b)); }
XK_LP_OPS_(::__half)
XK_LP_OPS_(::__nv_bfloat16)
#undef XK_LP_OPS_

// ----------------------------------------------------------------- vectors
namespace msl_detail {
// vector info: n = number of lanes (0: not vector-like), E = element, V = vec<E,n>
template <class X> struct vi { static constexpr int n = 0; };
template <class X> struct vi<const X> : vi<X> {};
template <class T, int N> struct vi<vec<T, N> > { static constexpr int n = N; typedef T E; typedef vec<T, N> V; };
template <class T, int N> struct vi<packed_vec<T, N> > { static constexpr int n = N; typedef T E; typedef vec<T, N> V; };
template <class T, int K> struct vi<cswz<T, K> > { static constexpr int n = K; typedef T E; typedef vec<T, K> V; };
template <class T, int S, int... I> struct vi<pswz<T, S, I...> > {
  static constexpr int n = sizeof...(I); typedef T E; typedef vec<T, sizeof...(I)> V;
};
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

template <class T, class S> inline T conv(const S& s) {
  if constexpr (lowp<T>::v && !same<T, S>::v) return T(float(s));
  else if constexpr (lowp<S>::v && !same<T, S>::v) return T(float(s));
  else return T(s);
}
template <class T, class X> inline void vput(T* dst, int& k, const X& x) {
  if constexpr (vi<X>::n == 0) {
    dst[k++] = conv<T>(x);
  } else {
    const auto& t = tov(x);
    for (int i = 0; i < int(vi<X>::n); ++i) dst[k++] = conv<T>(t.v[i]);
  }
}
}  // namespace msl_detail

#define XK_SWZ_COMMON_(K)                                                        \
  T& operator[](int i) { return this->v[IDX(i)]; }                               \
  const T& operator[](int i) const { return this->v[IDX(i)]; }                   \
  operator vec<T, K>() const { return get(); }                                   \
  template <class B> auto& operator+=(const B& b) { return *this = get() + b; }  \
  template <class B> auto& operator-=(const B& b) { return *this = get() - b; }  \
  template <class B> auto& operator*=(const B& b) { return *this = get() * b; }  \
  template <class B> auto& operator/=(const B& b) { return *this = get() / b; }

// Contiguous swizzle view (.xy .yz .zw .xyz ...): covers only its own lanes.
template <class T, int K> struct cstore;
template <class T> struct cstore<T, 2> { union { T v[2]; struct { T x, y; }; }; };
template <class T> struct cstore<T, 3> { union { T v[3]; struct { T x, y, z; }; }; };
template <class T> struct cstore<T, 4> { union { T v[4]; struct { T x, y, z, w; }; }; };
template <class T, int K> struct cswz : cstore<T, K> {
  static int IDX(int i) { return i; }
  vec<T, K> get() const { vec<T, K> r; for (int i = 0; i < K; ++i) r.v[i] = this->v[i]; return r; }
  cswz& operator=(const vec<T, K>& o) { for (int i = 0; i < K; ++i) this->v[i] = o.v[i]; return *this; }
  XK_SWZ_COMMON_(K)
};
// Non-contiguous / permuted swizzle view (.xz .yx .wzyx ...); S = lanes of the owner.
template <class T, int S, int... I> struct pswz {
  T v[S];
  pswz() = default;
  pswz(const pswz&) = default;
  pswz& operator=(const pswz&) = default;
  static int IDX(int i) { const int ix[] = {I...}; return ix[i]; }
  vec<T, sizeof...(I)> get() const { return vec<T, sizeof...(I)>(v[I]...); }
  pswz& operator=(const vec<T, sizeof...(I)>& o) {
    const vec<T, sizeof...(I)> t = o;
    int k = 0;
    ((v[I] = t.v[k++]), ...);
    return *this;
  }
  XK_SWZ_COMMON_(int(sizeof...(I)))
};
#undef XK_SWZ_COMMON_

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
    struct { T xk_p0_; cswz<T, 2> yz; };
    struct { T xk_p1_; cswz<T, 2> gb; };
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
    struct { T xk_p0_; cswz<T, 2> yz; };
    struct { T xk_p1_; cswz<T, 2> gb; };
    cswz<T, 3> xyz, rgb;
    struct { T xk_p2_; cswz<T, 3> yzw; };
    struct { T xk_p3_; cswz<T, 3> gba; };
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
    const T t = msl_detail::conv<T>(s);
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
};

// packed_<type><n>: element-aligned, no padding (packed_float3 is 12 bytes)
template <class T, int N> struct pstore;
template <class T> struct pstore<T, 2> { union { T v[2]; struct { T x, y; }; }; };
template <class T> struct pstore<T, 3> { union { T v[3]; struct { T x, y, z; }; }; };
template <class T> struct pstore<T, 4> { union { T v[4]; struct { T x, y, z, w; }; }; };
template <class T, int N> struct packed_vec : pstore<T, N> {
  typedef T value_type;
  packed_vec() = default;
  packed_vec(const vec<T, N>& o) { for (int i = 0; i < N; ++i) this->v[i] = o.v[i]; }
  vec<T, N> get() const { vec<T, N> r; for (int i = 0; i < N; ++i) r.v[i] = this->v[i]; return r; }
  operator vec<T, N>() const { return get(); }
  T& operator[](int i) { return this->v[i]; }
  const T& operator[](int i) const { return this->v[i]; }
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
  if constexpr (vi<X>::n == 0) return V(conv<typename V::value_type>(x));
  else return tov(x);
}
}  // namespace msl_detail

#define XK_VOP_(op)                                                                         \
  template <class A, class B>                                                               \
  inline typename msl_detail::bop<A, B>::V operator op(const A& a, const B& b) {            \
    typedef typename msl_detail::bop<A, B>::V V;                                            \
    typedef typename V::value_type E;                                                       \
    const V x = msl_detail::vcast<V>(a), y = msl_detail::vcast<V>(b);                       \
    V r;                                                                                    \
    for (int i = 0; i < int(msl_detail::vi<V>::n); ++i) r.v[i] = E(x.v[i] op y.v[i]);      \
    return r;                                                                               \
  }
XK_VOP_(+) XK_VOP_(-) XK_VOP_(*) XK_VOP_(/) XK_VOP_(%) XK_VOP_(&) XK_VOP_(|) XK_VOP_(^)
XK_VOP_(<<) XK_VOP_(>>)
#undef XK_VOP_
#define XK_VCMP_(op)                                                                        \
  template <class A, class B>                                                               \
  inline vec<bool, msl_detail::vi<typename msl_detail::bop<A, B>::V>::n> operator op(        \
      const A& a, const B& b) {                                                             \
    typedef typename msl_detail::bop<A, B>::V V;                                            \
    const V x = msl_detail::vcast<V>(a), y = msl_detail::vcast<V>(b);                       \
    vec<bool, msl_detail::vi<V>::n> r;                                                      \
    for (int i = 0; i < int(msl_detail::vi<V>::n); ++i) r.v[i] = bool(x.v[i] op y.v[i]);    \
    return r;                                                                               \
  }
XK_VCMP_(==) XK_VCMP_(!=) XK_VCMP_(<) XK_VCMP_(>) XK_VCMP_(<=) XK_VCMP_(>=)
#undef XK_VCMP_
template <class A> inline typename msl_detail::vi<A>::V operator-(const A& a) {
  typename msl_detail::vi<A>::V r = msl_detail::tov(a);
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) r.v[i] = -r.v[i];
  return r;
}
template <class A> inline typename msl_detail::vi<A>::V operator+(const A& a) { return msl_detail::tov(a); }

#define XK_VT_(T, name)                                                             \
  typedef vec<T, 2> name##2; typedef vec<T, 3> name##3; typedef vec<T, 4> name##4;  \
  typedef packed_vec<T, 2> packed_##name##2; typedef packed_vec<T, 3> packed_##name##3; \
  typedef packed_vec<T, 4> packed_##name##4;
XK_VT_(float, float) XK_VT_(half, half) XK_VT_(bfloat, bfloat) XK_VT_(int, int)
XK_VT_(uint, uint) XK_VT_(short, short) XK_VT_(ushort, ushort) XK_VT_(char, char)
XK_VT_(uchar, uchar) XK_VT_(bool, bool) XK_VT_(long, long) XK_VT_(ulong, ulong)
#undef XK_VT_

// ----------------------------------------------------------------- as_type
template <class T, class U> inline T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: source and destination sizes differ");
  T t;
  msl_detail::bytecopy(&t, &u, int(sizeof(T)));
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

template <class... X> struct okv { static constexpr int v = 1, n = 0; };
template <class X, class... R> struct okv<X, R...> {
  static constexpr int nx = vi<X>::n;
  static constexpr int n = nx ? nx : okv<R...>::n;
  static constexpr int v = (nx > 0 || sk<X>::v > 0) && okv<R...>::v && (nx == 0 || okv<R...>::n == 0 || nx == okv<R...>::n);
};
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
  if constexpr (vi<X>::n == 0) { (void)i; return conv<E>(x); }
  else return conv<E>(tov(x).v[i]);
}
template <class R> struct relem { typedef R E; };
template <class T, int N> struct relem<vec<T, N> > { typedef T E; };
template <class F, class R, class... X> inline R fap(const X&... x) {
  typedef typename relem<R>::E RE;
  if constexpr (vi<R>::n == 0) {
    return conv<RE>(F::f(conv<float>(x)...));
  } else {
    R r;
    for (int i = 0; i < int(vi<R>::n); ++i) r.v[i] = conv<RE>(F::f(ge<float>(x, i)...));
    return r;
  }
}
template <class F, class R, class... X> inline R gap(const X&... x) {
  typedef typename relem<R>::E E;
  if constexpr (vi<R>::n == 0) {
    return F::template f<E>(conv<E>(x)...);
  } else {
    R r;
    for (int i = 0; i < int(vi<R>::n); ++i) r.v[i] = F::template f<E>(ge<E>(x, i)...);
    return r;
  }
}
template <class E> inline E imn(E a, E b) {
  if constexpr (sk<E>::v == 2) return conv<E>(fminf(conv<float>(a), conv<float>(b)));
  else return b < a ? b : a;
}
template <class E> inline E imx(E a, E b) {
  if constexpr (sk<E>::v == 2) return conv<E>(fmaxf(conv<float>(a), conv<float>(b)));
  else return a < b ? b : a;
}
inline float smoothstep_f(float e0, float e1, float v) {
  float t = fminf(fmaxf((v - e0) / (e1 - e0), 0.0f), 1.0f);
  return t * t * (3.0f - 2.0f * t);
}
inline float fract_f(float x) { return fminf(x - floorf(x), 0x1.fffffep-1f); }
inline float sign_f(float x) { return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (fnan(x) ? 0.0f : x)); }
inline float rsqrt_precise(float x) { return 1.0f / sqrtf(x); }
template <class T> struct ubits { typedef typename cond<sizeof(T) == 1, unsigned char,
  typename cond<sizeof(T) == 2, unsigned short, typename cond<sizeof(T) == 4, unsigned, unsigned long long>::type>::type>::type type; };
}  // namespace msl_detail

// Float-computed functions: NS is the namespace (metal::, metal::precise::,
// metal::fast::), NAME the Metal name, EXPR the float expression of x (y, z).
#define XK_FAP_ ::mlx::core::cu::msl_detail::fap
#define XK_FRT_ ::mlx::core::cu::msl_detail::frt
#define XK_F1_(TAG, name, expr)                                                              \
  struct F_##TAG##name { static inline float f(float x) { return expr; } };                   \
  template <class X> inline typename XK_FRT_<X>::type name(const X& x) {                     \
    return XK_FAP_<F_##TAG##name, typename XK_FRT_<X>::type>(x);                              \
  }
#define XK_F2_(TAG, name, expr)                                                              \
  struct F_##TAG##name { static inline float f(float x, float y) { return expr; } };          \
  template <class X, class Y> inline typename XK_FRT_<X, Y>::type name(const X& x, const Y& y) { \
    return XK_FAP_<F_##TAG##name, typename XK_FRT_<X, Y>::type>(x, y);                        \
  }
#define XK_F3_(TAG, name, expr)                                                              \
  struct F_##TAG##name { static inline float f(float x, float y, float z) { return expr; } }; \
  template <class X, class Y, class Z>                                                       \
  inline typename XK_FRT_<X, Y, Z>::type name(const X& x, const Y& y, const Z& z) {          \
    return XK_FAP_<F_##TAG##name, typename XK_FRT_<X, Y, Z>::type>(x, y, z);                  \
  }
#define XK_B1_(name, expr)                                                                   \
  struct B_##name { static inline bool f(float x) { return expr; } };                        \
  template <class X> inline typename ::mlx::core::cu::msl_detail::brt<X>::type name(const X& x) { \
    return XK_FAP_<B_##name, typename ::mlx::core::cu::msl_detail::brt<X>::type>(x);          \
  }

// Accurate versions (metal:: and metal::precise::): CUDA's libdevice functions
// (a few ulp at most; sqrt and division are correctly rounded).
XK_F1_(p_, sqrt, sqrtf(x))
XK_F1_(p_, rsqrt, msl_detail::rsqrt_precise(x))
XK_F1_(p_, exp, expf(x))
XK_F1_(p_, exp2, exp2f(x))
XK_F1_(p_, exp10, exp10f(x))
XK_F1_(p_, log, logf(x))
XK_F1_(p_, log2, log2f(x))
XK_F1_(p_, log10, log10f(x))
XK_F1_(p_, sin, sinf(x))
XK_F1_(p_, cos, cosf(x))
XK_F1_(p_, tan, tanf(x))
XK_F1_(p_, asin, asinf(x))
XK_F1_(p_, acos, acosf(x))
XK_F1_(p_, atan, atanf(x))
XK_F1_(p_, sinh, sinhf(x))
XK_F1_(p_, cosh, coshf(x))
XK_F1_(p_, tanh, tanhf(x))
XK_F1_(p_, asinh, asinhf(x))
XK_F1_(p_, acosh, acoshf(x))
XK_F1_(p_, atanh, atanhf(x))
XK_F1_(p_, sinpi, sinpif(x))
XK_F1_(p_, cospi, cospif(x))
XK_F1_(p_, tanpi, tanf(M_PI_F * x))
XK_F1_(p_, floor, floorf(x))
XK_F1_(p_, ceil, ceilf(x))
XK_F1_(p_, round, roundf(x))
XK_F1_(p_, rint, rintf(x))
XK_F1_(p_, trunc, truncf(x))
XK_F1_(p_, fract, msl_detail::fract_f(x))
XK_F1_(p_, fabs, fabsf(x))
XK_F1_(p_, sign, msl_detail::sign_f(x))
XK_F1_(p_, saturate, fminf(fmaxf(x, 0.0f), 1.0f))
XK_F2_(p_, pow, powf(x, y))
XK_F2_(p_, powr, powf(x, y))
XK_F2_(p_, atan2, atan2f(x, y))
XK_F2_(p_, fmod, fmodf(x, y))
XK_F2_(p_, copysign, copysignf(x, y))
XK_F2_(p_, fdim, fdimf(x, y))
XK_F2_(p_, fmin, fminf(x, y))
XK_F2_(p_, fmax, fmaxf(x, y))
XK_F2_(p_, step, y < x ? 0.0f : 1.0f)
XK_F2_(p_, divide, x / y)
XK_F2_(p_, nextafter, nextafterf(x, y))
XK_F3_(p_, fma, fmaf(x, y, z))
XK_F3_(p_, mad, fmaf(x, y, z))
XK_F3_(p_, mix, x + (y - x) * z)
XK_F3_(p_, smoothstep, msl_detail::smoothstep_f(x, y, z))
XK_F3_(p_, fmin3, fminf(fminf(x, y), z))
XK_F3_(p_, fmax3, fmaxf(fmaxf(x, y), z))
XK_F3_(p_, fmedian3, fmaxf(fminf(x, y), fminf(fmaxf(x, y), z)))
XK_B1_(isnan, msl_detail::fnan(x))
XK_B1_(isinf, msl_detail::finf(x))
XK_B1_(isfinite, (msl_detail::f2u(x) & 0x7f800000u) != 0x7f800000u)
XK_B1_(signbit, (msl_detail::f2u(x) >> 31) != 0u)

// ---- type-preserving functions (integers stay integers)
namespace msl_detail {
struct G_abs { template <class E> static inline E f(E a) {
  if constexpr (sk<E>::v == 2) return conv<E>(fabsf(conv<float>(a)));
  else if constexpr (E(-1) < E(0)) return a < E(0) ? E(0ull - (unsigned long long)a) : a;
  else return a;
} };
struct G_min { template <class E> static inline E f(E a, E b) { return imn(a, b); } };
struct G_max { template <class E> static inline E f(E a, E b) { return imx(a, b); } };
struct G_clamp { template <class E> static inline E f(E a, E b, E c) { return imn(imx(a, b), c); } };
struct G_min3 { template <class E> static inline E f(E a, E b, E c) { return imn(imn(a, b), c); } };
struct G_max3 { template <class E> static inline E f(E a, E b, E c) { return imx(imx(a, b), c); } };
struct G_median3 { template <class E> static inline E f(E a, E b, E c) { return imx(imn(a, b), imn(imx(a, b), c)); } };
struct G_popcount { template <class E> static inline E f(E a) {
  return E(__popcll((unsigned long long)(typename ubits<E>::type)a));
} };
struct G_clz { template <class E> static inline E f(E a) {
  typedef typename ubits<E>::type U; const U u = U(a);
  return E(__clzll((long long)(unsigned long long)u) - (64 - 8 * int(sizeof(E))));
} };
struct G_ctz { template <class E> static inline E f(E a) {
  typedef typename ubits<E>::type U; const U u = U(a);
  return u == 0 ? E(8 * sizeof(E)) : E(__ffsll((long long)(unsigned long long)u) - 1);
} };
struct G_mulhi { template <class E> static inline E f(E a, E b) {
  if constexpr (sizeof(E) == 8) {
    if constexpr (E(-1) < E(0)) return E(__mul64hi((long long)a, (long long)b));
    else return E(__umul64hi((unsigned long long)a, (unsigned long long)b));
  } else {
    return E(((long long)a * (long long)b) >> (8 * sizeof(E)));
  }
} };
}  // namespace msl_detail
template <class X> inline typename msl_detail::grt<X>::type abs(const X& a) {
  return msl_detail::gap<msl_detail::G_abs, typename msl_detail::grt<X>::type>(a);
}
template <class X> inline typename msl_detail::grt<X>::type popcount(const X& a) {
  return msl_detail::gap<msl_detail::G_popcount, typename msl_detail::grt<X>::type>(a);
}
template <class X> inline typename msl_detail::grt<X>::type clz(const X& a) {
  return msl_detail::gap<msl_detail::G_clz, typename msl_detail::grt<X>::type>(a);
}
template <class X> inline typename msl_detail::grt<X>::type ctz(const X& a) {
  return msl_detail::gap<msl_detail::G_ctz, typename msl_detail::grt<X>::type>(a);
}
#define XK_G2_(name)                                                                             \
  template <class X, class Y> inline typename msl_detail::grt<X, Y>::type name(const X& a, const Y& b) { \
    return msl_detail::gap<msl_detail::G_##name, typename msl_detail::grt<X, Y>::type>(a, b);   \
  }
#define XK_G3_(name)                                                                             \
  template <class X, class Y, class Z>                                                           \
  inline typename msl_detail::grt<X, Y, Z>::type name(const X& a, const Y& b, const Z& c) {     \
    return msl_detail::gap<msl_detail::G_##name, typename msl_detail::grt<X, Y, Z>::type>(a, b, c); \
  }
XK_G2_(min) XK_G2_(max) XK_G2_(mulhi)
XK_G3_(clamp) XK_G3_(min3) XK_G3_(max3) XK_G3_(median3)
#undef XK_G2_
#undef XK_G3_

// select(a, b, c): c ? b : a, lane-wise
template <class A, class B, class C>
inline typename msl_detail::en<msl_detail::okv<A, B, C>::v, typename msl_detail::grt<A, B>::type>::type
select(const A& a, const B& b, const C& c) {
  typedef typename msl_detail::grt<A, B>::type R;
  typedef typename msl_detail::relem<R>::E E;
  if constexpr (msl_detail::vi<R>::n == 0) {
    return bool(c) ? msl_detail::conv<E>(b) : msl_detail::conv<E>(a);
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
template <class A, class B, bool ok> struct geo2_ {};
template <class A, class B> struct geo2_<A, B, true> {
  typedef typename fres<typename vi<A>::E>::type S;
  typedef vec<S, vi<A>::n> V;
};
template <class A, class B> struct geo : geo2_<A, B, (vi<A>::n > 0) && int(vi<A>::n) == int(vi<B>::n)> {};
template <class A> struct geo1 : geo2_<A, A, (vi<A>::n > 0)> {};
template <class A, class B> inline float dotf(const A& a, const B& b) {
  const auto& x = tov(a);
  const auto& y = tov(b);
  float s = 0.0f;
  for (int i = 0; i < int(vi<A>::n); ++i) s += conv<float>(x.v[i]) * conv<float>(y.v[i]);
  return s;
}
}  // namespace msl_detail
template <class A, class B> inline typename msl_detail::geo<A, B>::S dot(const A& a, const B& b) {
  return msl_detail::conv<typename msl_detail::geo<A, B>::S>(msl_detail::dotf(a, b));
}
template <class A> inline typename msl_detail::geo1<A>::S length_squared(const A& a) {
  return msl_detail::conv<typename msl_detail::geo1<A>::S>(msl_detail::dotf(a, a));
}
template <class A> inline typename msl_detail::geo1<A>::S length(const A& a) {
  return msl_detail::conv<typename msl_detail::geo1<A>::S>(sqrtf(msl_detail::dotf(a, a)));
}
template <class A> inline typename msl_detail::geo1<A>::V normalize(const A& a) {
  const auto& x = msl_detail::tov(a);
  const float k = 1.0f / sqrtf(msl_detail::dotf(a, a));
  typename msl_detail::geo1<A>::V r;
  for (int i = 0; i < int(msl_detail::vi<A>::n); ++i) r.v[i] = msl_detail::conv<typename msl_detail::geo1<A>::S>(msl_detail::conv<float>(x.v[i]) * k);
  return r;
}

// The fast versions (metal::fast::): hardware approximations where they meet Metal's
// fast-math error bounds; tanh stays accurate (tanh.approx is off by ~1e-3). exp2 is the
// hardware's with subnormal results flushed to zero, as Metal's fast math does (exp2f
// gives the same value for normal results, after a range test and two scalings); exp is
// exp2(x * log2(e)) the same way (what __expf computes, without its subnormal handling).
namespace msl_detail {
inline float ex2_ftz(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
}  // namespace msl_detail
namespace fast_impl {
XK_F1_(f_, exp, msl_detail::ex2_ftz(x * 1.4426950408889634f))
XK_F1_(f_, exp2, msl_detail::ex2_ftz(x))
XK_F1_(f_, log, __logf(x))
XK_F1_(f_, log2, __log2f(x))
XK_F1_(f_, sin, __sinf(x))
XK_F1_(f_, cos, __cosf(x))
XK_F1_(f_, rsqrt, rsqrtf(x))
XK_F1_(f_, sqrt, sqrtf(x))
XK_F1_(f_, tanh, tanhf(x))
XK_F2_(f_, pow, __powf(x, y))
XK_F2_(f_, divide, __fdividef(x, y))
}  // namespace fast_impl
#undef XK_F1_
#undef XK_F2_
#undef XK_F3_
#undef XK_B1_
#undef XK_FAP_
#undef XK_FRT_

#define XK_USING_ACC_                                                                        \
  using mlx::core::cu::sqrt; using mlx::core::cu::rsqrt; using mlx::core::cu::exp;          \
  using mlx::core::cu::exp2; using mlx::core::cu::log; using mlx::core::cu::log2;           \
  using mlx::core::cu::sin; using mlx::core::cu::cos; using mlx::core::cu::tanh;            \
  using mlx::core::cu::pow; using mlx::core::cu::divide;
#define XK_USING_MATH_                                                                       \
  using mlx::core::cu::exp10; using mlx::core::cu::log10;                                    \
  using mlx::core::cu::tan; using mlx::core::cu::asin;                                       \
  using mlx::core::cu::acos; using mlx::core::cu::atan; using mlx::core::cu::sinh;          \
  using mlx::core::cu::cosh; using mlx::core::cu::asinh;                                     \
  using mlx::core::cu::acosh; using mlx::core::cu::atanh; using mlx::core::cu::sinpi;       \
  using mlx::core::cu::cospi; using mlx::core::cu::tanpi; using mlx::core::cu::floor;       \
  using mlx::core::cu::ceil; using mlx::core::cu::round; using mlx::core::cu::rint;         \
  using mlx::core::cu::trunc; using mlx::core::cu::fract; using mlx::core::cu::fabs;        \
  using mlx::core::cu::sign; using mlx::core::cu::saturate;                                  \
  using mlx::core::cu::powr; using mlx::core::cu::atan2; using mlx::core::cu::fmod;         \
  using mlx::core::cu::copysign; using mlx::core::cu::fdim; using mlx::core::cu::fmin;      \
  using mlx::core::cu::fmax; using mlx::core::cu::step;                                      \
  using mlx::core::cu::nextafter; using mlx::core::cu::fma; using mlx::core::cu::mad;       \
  using mlx::core::cu::mix; using mlx::core::cu::smoothstep; using mlx::core::cu::fmin3;    \
  using mlx::core::cu::fmax3; using mlx::core::cu::fmedian3; using mlx::core::cu::abs;      \
  using mlx::core::cu::min; using mlx::core::cu::max; using mlx::core::cu::clamp;           \
  using mlx::core::cu::min3; using mlx::core::cu::max3; using mlx::core::cu::median3;       \
  using mlx::core::cu::dot; using mlx::core::cu::length; using mlx::core::cu::normalize;    \
  using mlx::core::cu::length_squared; using mlx::core::cu::isnan; using mlx::core::cu::isinf; \
  using mlx::core::cu::isfinite; using mlx::core::cu::signbit; using mlx::core::cu::select; \
  using mlx::core::cu::all; using mlx::core::cu::any; using mlx::core::cu::popcount;        \
  using mlx::core::cu::clz; using mlx::core::cu::ctz; using mlx::core::cu::mulhi;           \
  using mlx::core::cu::as_type;

namespace metal {
XK_USING_MATH_
XK_USING_ACC_
template <class T> using numeric_limits = cuda::std::numeric_limits<T>;
namespace precise {
XK_USING_MATH_
XK_USING_ACC_
}
namespace fast {
XK_USING_MATH_
using fast_impl::exp; using fast_impl::exp2; using fast_impl::log; using fast_impl::log2;
using fast_impl::sin; using fast_impl::cos; using fast_impl::rsqrt; using fast_impl::sqrt;
using fast_impl::tanh; using fast_impl::pow; using fast_impl::divide;
}
}  // namespace metal
#undef XK_USING_ACC_
#undef XK_USING_MATH_

// ----------------------------------------------------------------- barriers
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
inline constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(unsigned(a) | unsigned(b)); }

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none) { __syncthreads(); }
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none) { __syncwarp(__activemask()); }

// ----------------------------------------------------------------- simd collectives
namespace msl_detail {
inline uint lane_id() {
  uint r;
  asm volatile("mov.u32 %0, %%laneid;" : "=r"(r));
  return r;
}
// Shuffle a scalar or vector from lane `src` (vectors lane by lane; small integers and
// bool through int; CUDA's own overloads for float, 64-bit, half and bfloat).
template <class T> inline T shfl_any(unsigned mask, const T& v, int src) {
  if constexpr (vi<T>::n > 0) {
    typename vi<T>::V r = tov(v);
#pragma unroll
    for (int i = 0; i < int(vi<T>::n); ++i) r.v[i] = shfl_any(mask, r.v[i], src);
    return r;
  } else if constexpr (sk<T>::v == 1 && sizeof(T) <= 4) {
    return T(__shfl_sync(mask, int(v), src));
  } else {
    return __shfl_sync(mask, v, src);
  }
}

template <class T> struct elems {
  typedef T type;
  static constexpr int n = 1;
  static T& at(T& v, int) { return v; }
  static const T& at(const T& v, int) { return v; }
};
template <class T, int N> struct elems<vec<T, N> > {
  typedef T type;
  static constexpr int n = N;
  static T& at(vec<T, N>& v, int i) { return v[i]; }
  static const T& at(const vec<T, N>& v, int i) { return v[i]; }
};
// Reductions of half and bfloat accumulate in float.
template <class T> struct acc { typedef T type; };
template <> struct acc<::__half> { typedef float type; };
template <> struct acc<::__nv_bfloat16> { typedef float type; };

struct op_sum { template <class A> static A apply(A a, A b) { return a + b; }
                template <class A> static A identity() { return A(0); } };
struct op_product { template <class A> static A apply(A a, A b) { return a * b; }
                    template <class A> static A identity() { return A(1); } };
struct op_max { template <class A> static A apply(A a, A b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
} };
struct op_min { template <class A> static A apply(A a, A b) {
  if (a != a) return a;
  if (b != b) return b;
  return a < b ? a : b;
} };
struct op_and { template <class A> static A apply(A a, A b) { return a & b; } };
struct op_or { template <class A> static A apply(A a, A b) { return a | b; } };
struct op_xor { template <class A> static A apply(A a, A b) { return a ^ b; } };

// Reduce over the active lanes of each group of G lanes (G = 32: simdgroup, 4: quad).
// Whole warp: xor butterfly (every lane gets bit-identical results, IEEE + and * commute).
// Otherwise: every active lane reads every active lane in lane order (the loop has the
// same trip count on all of them) and keeps those of its own group.
// ALL: the caller guarantees a whole warp (xk_simd_sum_all): the butterfly only, with no
// __activemask() test and no partial-warp code (whose registers ptxas keeps otherwise).
template <class Op, int G, bool ALL = false, class T> inline T reduce(const T& data) {
  typedef elems<T> EL;
  typedef typename EL::type E;
  typedef typename acc<E>::type A;
  const unsigned mask = ALL ? 0xffffffffu : __activemask();
  const int lane = int(lane_id());
  T out = data;
#pragma unroll
  for (int k = 0; k < EL::n; ++k) {
    A a = conv<A>(EL::at(data, k));
    if (ALL || mask == 0xffffffffu) {
#pragma unroll
      for (int off = G / 2; off > 0; off >>= 1) {
        if constexpr (ALL && (same<A, float>::v || same<A, int>::v || same<A, unsigned>::v)) {
          a = Op::apply(a, __shfl_xor_sync(0xffffffffu, a, off));  // SHFL.BFLY
        } else {
          a = Op::apply(a, shfl_any(mask, a, lane ^ off));
        }
      }
    } else {
      const int g0 = lane / G * G;
      bool first = true;
      A r = a;
      for (unsigned m = mask; m; m &= m - 1) {
        const int src = __ffs(m) - 1;
        const A o = shfl_any(mask, a, src);
        if (src >= g0 && src < g0 + G) {
          r = first ? o : Op::apply(r, o);
          first = false;
        }
      }
      a = r;
    }
    EL::at(out, k) = conv<E>(a);
  }
  return out;
}

// Prefix over the active lanes in lane order (exclusive: the identity for the first).
template <class Op, bool Inclusive, int G, class T> inline T prefix(const T& data) {
  typedef elems<T> EL;
  typedef typename EL::type E;
  typedef typename acc<E>::type A;
  const unsigned mask = __activemask();
  const int lane = int(lane_id());
  T out = data;
#pragma unroll
  for (int k = 0; k < EL::n; ++k) {
    const A a = conv<A>(EL::at(data, k));
    A r;
    if (mask == 0xffffffffu && G == 32) {
      // Hillis-Steele inclusive scan, then shift for the exclusive one.
      A x = a;
#pragma unroll
      for (int d = 1; d < 32; d <<= 1) {
        const A y = shfl_any(mask, x, lane >= d ? lane - d : lane);
        if (lane >= d) x = Op::apply(y, x);
      }
      if (Inclusive) {
        r = x;
      } else {
        const A y = shfl_any(mask, x, lane >= 1 ? lane - 1 : lane);
        r = lane >= 1 ? y : Op::template identity<A>();
      }
    } else {
      const int g0 = lane / G * G;
      A run = Op::template identity<A>();
      r = run;
      for (unsigned m = mask; m; m &= m - 1) {
        const int src = __ffs(m) - 1;
        const A o = shfl_any(mask, a, src);
        if (src >= g0 && src < lane) run = Op::apply(run, o);
        if (src == lane) r = Inclusive ? Op::apply(run, o) : run;
      }
    }
    EL::at(out, k) = conv<E>(r);
  }
  return out;
}
}  // namespace msl_detail

#define XK_REDUCE_(NAME, OP, G) \
  template <class T> inline T NAME(T data) { return msl_detail::reduce<msl_detail::OP, G>(data); }
XK_REDUCE_(simd_sum, op_sum, 32)
XK_REDUCE_(simd_product, op_product, 32)
XK_REDUCE_(simd_max, op_max, 32)
XK_REDUCE_(simd_min, op_min, 32)
XK_REDUCE_(simd_and, op_and, 32)
XK_REDUCE_(simd_or, op_or, 32)
XK_REDUCE_(simd_xor, op_xor, 32)
XK_REDUCE_(quad_sum, op_sum, 4)
XK_REDUCE_(quad_product, op_product, 4)
XK_REDUCE_(quad_max, op_max, 4)
XK_REDUCE_(quad_min, op_min, 4)
XK_REDUCE_(quad_and, op_and, 4)
XK_REDUCE_(quad_or, op_or, 4)
XK_REDUCE_(quad_xor, op_xor, 4)
#undef XK_REDUCE_
// simd_sum for callers whose simdgroup has all 32 lanes active (metal_src/norm.metal's row
// sums); the Metal bodies fall back to simd_sum where XK_SIMD_SUM_ALL is not defined.
#define XK_SIMD_SUM_ALL
template <class T> inline T xk_simd_sum_all(T data) { return msl_detail::reduce<msl_detail::op_sum, 32, true>(data); }
// simd_shuffle_xor for the same callers (a float from lane ^ m of a fully active warp).
inline float xk_shuffle_xor_all(float data, ushort m) { return __shfl_xor_sync(0xffffffffu, data, int(m)); }
#define XK_PREFIX_(NAME, OP, INCL, G) \
  template <class T> inline T NAME(T data) { return msl_detail::prefix<msl_detail::OP, INCL, G>(data); }
XK_PREFIX_(simd_prefix_inclusive_sum, op_sum, true, 32)
XK_PREFIX_(simd_prefix_exclusive_sum, op_sum, false, 32)
XK_PREFIX_(simd_prefix_inclusive_product, op_product, true, 32)
XK_PREFIX_(simd_prefix_exclusive_product, op_product, false, 32)
XK_PREFIX_(quad_prefix_inclusive_sum, op_sum, true, 4)
XK_PREFIX_(quad_prefix_exclusive_sum, op_sum, false, 4)
XK_PREFIX_(quad_prefix_inclusive_product, op_product, true, 4)
XK_PREFIX_(quad_prefix_exclusive_product, op_product, false, 4)
#undef XK_PREFIX_

// Shuffles: reading an inactive lane is undefined (as on Metal).
template <class T> inline T simd_shuffle(T data, ushort src) {
  return msl_detail::shfl_any(__activemask(), data, int(src) & 31);
}
template <class T> inline T simd_broadcast(T data, ushort src) { return simd_shuffle(data, src); }
template <class T> inline T simd_shuffle_xor(T data, ushort m) {
  const int lane = int(msl_detail::lane_id());
  const int src = lane ^ int(m);
  return msl_detail::shfl_any(__activemask(), data, src < 32 ? src : lane);
}
template <class T> inline T simd_shuffle_up(T data, ushort d) {
  const int lane = int(msl_detail::lane_id());
  return msl_detail::shfl_any(__activemask(), data, lane >= int(d) ? lane - int(d) : lane);
}
template <class T> inline T simd_shuffle_down(T data, ushort d) {
  const int lane = int(msl_detail::lane_id());
  return msl_detail::shfl_any(__activemask(), data, lane + int(d) < 32 ? lane + int(d) : lane);
}
template <class T> inline T simd_shuffle_rotate_up(T data, ushort d) {
  const int lane = int(msl_detail::lane_id());
  return msl_detail::shfl_any(__activemask(), data, (lane - int(d)) & 31);
}
template <class T> inline T simd_shuffle_rotate_down(T data, ushort d) {
  const int lane = int(msl_detail::lane_id());
  return msl_detail::shfl_any(__activemask(), data, (lane + int(d)) & 31);
}
template <class T> inline T simd_broadcast_first(T data) {
  const unsigned mask = __activemask();
  return msl_detail::shfl_any(mask, data, __ffs(mask) - 1);
}
template <class T> inline T quad_shuffle(T data, ushort src) {
  const int lane = int(msl_detail::lane_id());
  return msl_detail::shfl_any(__activemask(), data, (lane & ~3) | (int(src) & 3));
}
template <class T> inline T quad_broadcast(T data, ushort src) { return quad_shuffle(data, src); }
template <class T> inline T quad_shuffle_xor(T data, ushort m) {
  const int lane = int(msl_detail::lane_id());
  return msl_detail::shfl_any(__activemask(), data, (lane & ~3) | ((lane ^ int(m)) & 3));
}
template <class T> inline T quad_shuffle_up(T data, ushort d) {
  const int lane = int(msl_detail::lane_id());
  const int i = lane & 3;
  return msl_detail::shfl_any(__activemask(), data, i >= int(d) ? lane - int(d) : lane);
}
template <class T> inline T quad_shuffle_down(T data, ushort d) {
  const int lane = int(msl_detail::lane_id());
  const int i = lane & 3;
  return msl_detail::shfl_any(__activemask(), data, i + int(d) < 4 ? lane + int(d) : lane);
}

// Votes
struct simd_vote {
  typedef unsigned long long vote_t;
  vote_t v;
  simd_vote() = default;
  explicit constexpr simd_vote(vote_t x) : v(x) {}
  explicit constexpr operator vote_t() const { return v; }
  constexpr bool all() const { return v == 0xFFFFFFFFull; }
  constexpr bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool expr) { return simd_vote(__ballot_sync(__activemask(), expr)); }
inline simd_vote simd_active_threads_mask() { return simd_vote(__activemask()); }
inline bool simd_all(bool expr) { return __all_sync(__activemask(), expr); }
inline bool simd_any(bool expr) { return __any_sync(__activemask(), expr); }
inline bool simd_is_first() { return int(msl_detail::lane_id()) == __ffs(__activemask()) - 1; }

// ----------------------------------------------------------------- simdgroup_matrix
// Element layout: the tensor cores' accumulator layout (PTX mma.m16n8k8, rows 0-7): lane
// 4g + t holds M[g][2t] and M[g][2t + 1]. Metal leaves the layout to the implementation;
// metal_src bodies ask xk_frag_coord (metal_src/_simdgroup.metal: Apple's layout unless
// XK_SIMDGROUP_LAYOUT is defined, as here).
#define XK_SIMDGROUP_LAYOUT 1
#define XK_FRAG_ROW_XOR_A 1  // the lanes 4g .. 4g + 3 of one row differ in lane bits 1 and 2
#define XK_FRAG_ROW_XOR_B 2
#define XK_FRAG_COL_XOR_A 4  // the lanes t, 4 + t, .., 28 + t of one column pair differ in lane bits 2-4
#define XK_FRAG_COL_XOR_B 8
#define XK_FRAG_COL_XOR_C 16
namespace msl_detail {
inline void lane_coord(uint lane, int& row, int& col) {
  row = int(lane / 4);
  col = int(lane % 4) * 2;
}
// The lane holding elements (row, 2p) and (row, 2p + 1).
inline int lane_of(int row, int p) { return 4 * row + p; }
}  // namespace msl_detail
inline void xk_frag_coord(uint lane, int& row, int& col) { msl_detail::lane_coord(lane, row, col); }

// ----------------------------------------------------------------- MLX's Metal prelude
template <typename T, typename U> inline T ceildiv(T n, U m) { return (n + m - 1) / m; }

// elem_to_loc on the Shape / Strides arrays cuda_kernel passes for `<name>_shape` etc.
template <typename IdxT>
inline IdxT elem_to_loc(IdxT elem, const Shape& shape, const Strides& strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % IdxT(shape[i])) * IdxT(strides[i]);
    elem /= IdxT(shape[i]);
  }
  return loc;
}
template <typename IdxT = int64_t>
inline IdxT elem_to_loc(uint3 elem, const Shape& shape, const Strides& strides, int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) + IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += IdxT(elem.z % uint(shape[d])) * IdxT(strides[d]);
    elem.z /= uint(shape[d]);
  }
  return loc;
}

// Dynamic threadgroup memory. A body may take its (one) large threadgroup buffer as
//   #ifdef XK_THREADGROUP_DYNAMIC
//   threadgroup T* name = XK_THREADGROUP_DYNAMIC(count, T);
//   #else
//   threadgroup T name[count];
//   #endif
// Here the buffer is the launch's dynamic shared memory (16-byte aligned; more than the
// 48 KiB of static shared memory when the host asks for it: the factory's `shared_memory`,
// which MLX's cuda_kernel turns into cudaFuncAttributeMaxDynamicSharedMemorySize). A launch
// given fewer than count * sizeof(T) bytes traps instead of overrunning the buffer.
#define XK_THREADGROUP_DYNAMIC(count, ...) \
  (::mlx::core::cu::msl_detail::dynamic_threadgroup<__VA_ARGS__>(sizeof(__VA_ARGS__) * size_t(count)))
namespace msl_detail {
template <class T> inline T* dynamic_threadgroup(size_t bytes) {
  extern __shared__ __align__(16) unsigned char xk_dynamic_threadgroup_[];
  unsigned have;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(have));
  if (size_t(have) < bytes) __trap();
  return reinterpret_cast<T*>(xk_dynamic_threadgroup_);
}
}  // namespace msl_detail

// ---- Threadgroup clusters (metal_src/_cluster.metal) -------------------------------------
// Defined for a launch whose template names XK_CLUSTER > 1 (the header then defines
// XK_CLUSTER_DIMS; clusters need sm_90): the kernel gets __cluster_dims__(XK_CLUSTER_DIMS, 1,
// 1) below, a cluster sync is barrier.cluster (release / acquire, every thread of the
// cluster), a peer's threadgroup memory a generic address from mapa (Hopper's distributed
// shared memory). Without XK_CLUSTER_DIMS, _cluster.metal's stand-ins apply (XK_CLUSTER_MAX 1).
#ifdef XK_CLUSTER_DIMS
#define XK_CLUSTER_NATIVE 1
#define XK_CLUSTER_MAX 8
__device__ __forceinline__ void xk_cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <typename T>
__device__ __forceinline__ T* xk_cluster_peer(T* p, unsigned rank) {
  unsigned long long a;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(a) : "l"(reinterpret_cast<unsigned long long>(p)), "r"(rank));
  return reinterpret_cast<T*>(a);
}
#endif

}  // namespace mlx::core::cu

// Registers: the kernel is compiled for its launch's threadgroup size, so a
// 1024-thread threadgroup never fails to launch for lack of registers. A launch whose
// template names XK_MIN_BLOCKS (an occupancy hint: other backends ignore it) also asks
// for that many resident blocks per SM, which caps the registers per thread at
// 65536 / (XK_MAX_THREADS * XK_MIN_BLOCKS); the header defines it as XK_LAUNCH_MIN_BLOCKS (e.g. 48 for 128 threads x 10 blocks).
// A launch in clusters (XK_CLUSTER_DIMS, above) adds the kernel's cluster shape.
#ifdef XK_CLUSTER_DIMS
#define XK_CLUSTER_ATTRIBUTE __cluster_dims__(XK_CLUSTER_DIMS, 1, 1)
#else
#define XK_CLUSTER_ATTRIBUTE
#endif
#undef __global__
#ifdef XK_LAUNCH_MIN_BLOCKS
#define __global__ __location__(global) __launch_bounds__(XK_MAX_THREADS, XK_LAUNCH_MIN_BLOCKS) XK_CLUSTER_ATTRIBUTE
#else
#define __global__ __location__(global) __launch_bounds__(XK_MAX_THREADS) XK_CLUSTER_ATTRIBUTE
#endif

#endif  // XLSTM_CUDA_COMPAT_H
