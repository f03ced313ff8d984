// Exhaustive check behind LN_FWD_AFFINE_IN_T (metal_src/norm.metal, xk_mul_t / xk_add_t): for
// T = bfloat16 and half and every pair of finite T values a, b, the float route
// T(float(a) * float(b)) and T(float(a) + float(b)) (each conversion round-to-nearest-even)
// equals one correct rounding of the exact product / sum to T (what __hmul_rn / __hadd_rn
// compute), bit for bit, subnormals, signed zeros and overflow to inf included.
//
//   gcc -O2 -fopenmp -o /tmp/check_t_arithmetic scripts/check_t_arithmetic.c -lm && /tmp/check_t_arithmetic
//
// About 12 minutes on one core (session 51: 4,261,478,400 bf16 pairs and 4,030,726,144 half
// pairs, 0 mismatches for the product and the sum). Needs a compiler with _Float16 (gcc >= 12
// on x86-64). Not part of the test suite (too long); the GPU test that the kernels agree bit
// for bit is tests/test_norm.py::test_layer_norm_affine_in_t.
#include <stdio.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
static inline float bits_f(uint32_t u){float f;memcpy(&f,&u,4);return f;}
static inline uint32_t f_bits(float f){uint32_t u;memcpy(&u,&f,4);return u;}
static inline uint64_t d_bits(double f){uint64_t u;memcpy(&u,&f,8);return u;}
// direct RNE of a double to a format with p significand bits, exponents [emin, emax], subnormals, overflow->inf
static double rnd(double v,int p,int emin,int emax){
  uint64_t u=d_bits(v); int s=u>>63; int be=(u>>52)&0x7ff;
  if(be==0x7ff) return v; if(be==0) return v; /* 0 (no double subnormals arise) */
  int E=be-1023; uint64_t M=(u&((1ULL<<52)-1))|(1ULL<<52);
  int Ee=E<emin?emin:E; int shift=52-(p-1)+(Ee-E);
  uint64_t q;
  if(shift>=60){q=0;} else { uint64_t rem=M&((1ULL<<shift)-1), half=1ULL<<(shift-1); q=M>>shift;
    if(rem>half||(rem==half&&(q&1)))q++; }
  double r=ldexp((double)q,Ee-(p-1));
  if(r>=ldexp(1.0,emax+1)) r=INFINITY;
  return s?-r:r;
}
static inline float f2bf(float f){uint32_t u=f_bits(f); if((u&0x7fffffff)>0x7f800000) return f; u=(u+0x7fff+((u>>16)&1))&0xffff0000u; return bits_f(u);}
static inline int same(double a,double b){return d_bits(a)==d_bits(b);}
int main(){
  static float bf[65536], hf[65536]; static int bfok[65536], hfok[65536];
  for(uint32_t i=0;i<65536;i++){ bf[i]=bits_f(i<<16); bfok[i]=isfinite(bf[i]);
    uint16_t h=i; _Float16 x; memcpy(&x,&h,2); hf[i]=(float)x; hfok[i]=isfinite(hf[i]); }
  long long bad[8]={0}, n[2]={0}; long long sub_checked[2]={0};
  #pragma omp parallel for schedule(dynamic,64) reduction(+:bad[:8],n[:2],sub_checked[:2])
  for(int i=0;i<65536;i++){
    for(int j=0;j<65536;j++){
      if(bfok[i]&&bfok[j]){ float a=bf[i],b=bf[j]; n[0]++;
        // bf16: p=8, emin=-126, emax=127
        double rm=rnd((double)a*(double)b,8,-126,127), ra=rnd((double)a+(double)b,8,-126,127);
        volatile float pm=a*b, pa=a+b;
        double cm=f2bf(pm), ca=f2bf(pa);
        if(!same(rm,cm))bad[0]++; if(!same(ra,ca))bad[1]++;
        // cross-check the rounding helpers: rnd from the float result equals the bit trick
        if(!same(rnd((double)pm,8,-126,127),cm))bad[4]++;
        if(fabs(rm)<ldexp(1.0,-126)) sub_checked[0]++;
      }
      if(hfok[i]&&hfok[j]){ float a=hf[i],b=hf[j]; n[1]++;
        // half: p=11, emin=-14, emax=15; products/sums exact in double
        double rm=rnd((double)a*(double)b,11,-14,15), ra=rnd((double)a+(double)b,11,-14,15);
        volatile float pm=a*b, pa=a+b;
        double cm=(double)(float)(_Float16)pm, ca=(double)(float)(_Float16)pa;  // libgcc/F16C float->half RNE
        double rm2=(double)(float)(_Float16)((double)a*(double)b); // libgcc double->half, direct
        if(!same(rm,cm))bad[2]++; if(!same(ra,ca))bad[3]++;
        if(!same(rm,rm2))bad[5]++;
        if(fabs(rm)<ldexp(1.0,-14)) sub_checked[1]++;
      }
    }
  }
  printf("bf16 pairs %lld: mul mismatches %lld, add mismatches %lld (helper xcheck %lld); subnormal/zero products %lld\n",n[0],bad[0],bad[1],bad[4],sub_checked[0]);
  printf("half pairs %lld: mul mismatches %lld, add mismatches %lld (helper xcheck %lld); subnormal/zero products %lld\n",n[1],bad[2],bad[3],bad[5],sub_checked[1]);
  return 0;
}
