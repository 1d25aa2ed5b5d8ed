/* `cc -O2 -mavx512f scripts/read_bandwidth.c -o /tmp/readbw && /tmp/readbw FILE`: how fast one core reads FILE's memory map
 * in one sequential stream (four 64-byte AVX-512 loads per 256 bytes, best of 5), and the same bytes copied into
 * anonymous 2 MB pages. The rate the GGUF kernel's reading is held against (docs/RESULTS.md, "Where a pass's time goes"). */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <time.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(int argc,char**argv){
  int fd=open(argv[1],O_RDONLY); struct stat st; fstat(fd,&st); size_t n=st.st_size&~(size_t)4095;
  const char*p=mmap(0,n,PROT_READ,MAP_SHARED,fd,0);
  for(int huge=0;huge<2;huge++){
    const char*q=p; char*buf=0;
    if(huge){buf=aligned_alloc(1<<21,n); madvise(buf,n,MADV_HUGEPAGE); for(size_t i=0;i<n;i+=4096)buf[i]=1; q=buf;}
    double best=1e9; __m512i acc=_mm512_setzero_si512();
    for(int r=0;r<5;r++){double t=now();
      for(size_t i=0;i+256<=n;i+=256){acc=_mm512_xor_si512(acc,_mm512_loadu_si512(q+i));acc=_mm512_xor_si512(acc,_mm512_loadu_si512(q+i+64));acc=_mm512_xor_si512(acc,_mm512_loadu_si512(q+i+128));acc=_mm512_xor_si512(acc,_mm512_loadu_si512(q+i+192));}
      t=now()-t; if(t<best)best=t;}
    printf("%s: %.2f GB in %.1f ms best: %.1f GB/s (%d)\n", huge?"anonymous 2 MB pages":"file mmap 4 KB pages", n/1e9, best*1e3, n/best/1e9, _mm512_reduce_add_epi32(acc)&1);
  }
}
