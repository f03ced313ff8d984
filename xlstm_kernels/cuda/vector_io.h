// vector_io.h -- vectorised global-memory loads and stores for CUDA (placeholder).
