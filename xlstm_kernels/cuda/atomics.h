// atomics.h
// Metal's atomic<T> and atomic_*_explicit for CUDA.
// Included after compat.h by xlstm_kernels.cuda.kernel when a kernel's text needs it.
#ifndef XLSTM_CUDA_ATOMICS_H
#define XLSTM_CUDA_ATOMICS_H
namespace mlx::core::cu {

// ----------------------------------------------------------------- atomics
// atomic<T> has T's layout; every operation is a relaxed device-scope CUDA atomic.
enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst
};
template <class T> struct atomic {
  T xk_value_;
  atomic() = default;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<long> atomic_long;
typedef atomic<ulong> atomic_ulong;

namespace msl_detail {
template <class T> inline T* ap(volatile atomic<T>* o) { return const_cast<T*>(&o->xk_value_); }
template <class T, class F> inline T cas_rmw(volatile atomic<T>* o, F fn) {
  typedef typename cond<sizeof(T) == 8, unsigned long long, unsigned>::type U;
  static_assert(sizeof(T) == 4 || sizeof(T) == 8, "atomics need 4- or 8-byte types");
  U* p = reinterpret_cast<U*>(ap(o));
  U old = *reinterpret_cast<volatile U*>(p);
  for (;;) {
    T ov, nv;
    bytecopy(&ov, &old, int(sizeof(T)));
    nv = fn(ov);
    U nu;
    bytecopy(&nu, &nv, int(sizeof(T)));
    const U seen = atomicCAS(p, old, nu);
    if (seen == old) return ov;
    old = seen;
  }
}
template <class T> struct fmin_ { T v; T operator()(T a) const { return imn(a, v); } };
template <class T> struct fmax_ { T v; T operator()(T a) const { return imx(a, v); } };
template <class T> struct fset_ { T v; T operator()(T) const { return v; } };
}  // namespace msl_detail

template <class T>
inline void atomic_store_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                  memory_order = memory_order_relaxed) {
  msl_detail::cas_rmw(o, msl_detail::fset_<T>{v});
}
template <class T> inline T atomic_load_explicit(volatile atomic<T>* o, memory_order = memory_order_relaxed) {
  return *const_cast<volatile T*>(msl_detail::ap(o));
}
template <class T>
inline T atomic_exchange_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                  memory_order = memory_order_relaxed) {
  return msl_detail::cas_rmw(o, msl_detail::fset_<T>{v});
}
template <class T>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type* expected,
                                                  typename msl_detail::idt<T>::type desired,
                                                  memory_order = memory_order_relaxed,
                                                  memory_order = memory_order_relaxed) {
  typedef typename msl_detail::cond<sizeof(T) == 8, unsigned long long, unsigned>::type U;
  U e, d;
  msl_detail::bytecopy(&e, expected, int(sizeof(T)));
  msl_detail::bytecopy(&d, &desired, int(sizeof(T)));
  const U seen = atomicCAS(reinterpret_cast<U*>(msl_detail::ap(o)), e, d);
  if (seen == e) return true;
  msl_detail::bytecopy(expected, &seen, int(sizeof(T)));
  return false;
}
template <class T>
inline T atomic_fetch_add_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                   memory_order = memory_order_relaxed) {
  if constexpr (msl_detail::same<T, int>::v || msl_detail::same<T, unsigned>::v || msl_detail::same<T, float>::v)
    return atomicAdd(msl_detail::ap(o), v);
  else if constexpr (sizeof(T) == 8 && msl_detail::sk<T>::v == 1)
    return T(atomicAdd(reinterpret_cast<unsigned long long*>(msl_detail::ap(o)), (unsigned long long)v));
  else
    return msl_detail::cas_rmw(o, [v](T a) { return T(a + v); });
}
template <class T>
inline T atomic_fetch_sub_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                   memory_order = memory_order_relaxed) {
  if constexpr (msl_detail::same<T, int>::v || msl_detail::same<T, unsigned>::v)
    return atomicSub(msl_detail::ap(o), v);
  else
    return msl_detail::cas_rmw(o, [v](T a) { return T(a - v); });
}
template <class T>
inline T atomic_fetch_min_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                   memory_order = memory_order_relaxed) {
  if constexpr (msl_detail::same<T, int>::v || msl_detail::same<T, unsigned>::v)
    return atomicMin(msl_detail::ap(o), v);
  else
    return msl_detail::cas_rmw(o, msl_detail::fmin_<T>{v});
}
template <class T>
inline T atomic_fetch_max_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                   memory_order = memory_order_relaxed) {
  if constexpr (msl_detail::same<T, int>::v || msl_detail::same<T, unsigned>::v)
    return atomicMax(msl_detail::ap(o), v);
  else
    return msl_detail::cas_rmw(o, msl_detail::fmax_<T>{v});
}
template <class T>
inline T atomic_fetch_and_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                   memory_order = memory_order_relaxed) {
  return msl_detail::cas_rmw(o, [v](T a) { return T(a & v); });
}
template <class T>
inline T atomic_fetch_or_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                  memory_order = memory_order_relaxed) {
  return msl_detail::cas_rmw(o, [v](T a) { return T(a | v); });
}
template <class T>
inline T atomic_fetch_xor_explicit(volatile atomic<T>* o, typename msl_detail::idt<T>::type v,
                                   memory_order = memory_order_relaxed) {
  return msl_detail::cas_rmw(o, [v](T a) { return T(a ^ v); });
}

// `device atomic<T>*` view of an output (atomic_outputs=True).
template <class T> inline atomic<T>* xk_as_atomic(T* p) { return reinterpret_cast<atomic<T>*>(p); }

}  // namespace mlx::core::cu
#endif
