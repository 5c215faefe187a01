// What the AMX kernels share (bf16_amx_gemm.h, attention_kernels.h' AMX path): the tile configuration and
// a 16 x 16 transpose. A kernel header of the AMX copy (isa_variants.h) includes it once in its namespace.

// Palette 1, all eight tiles 16 rows x 64 bytes.
inline void amx_configure_tiles() {
  struct alignas(64) {
    uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  _tile_loadconfig(&config);
}

// In-register transpose of a 16 x 16 matrix of 32-bit elements, v[i] its row i in and its column i out.
inline void transpose16x16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    v[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    v[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    v[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    v[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // v[4i + q], 128-bit lane l: rows 4i..4i+3, column 4l + q; gather the lanes
  for (int q = 0; q < 4; ++q) {
    const __m512 b0 = _mm512_shuffle_f32x4(v[q], v[4 + q], 0x88), b1 = _mm512_shuffle_f32x4(v[q], v[4 + q], 0xdd);
    const __m512 b2 = _mm512_shuffle_f32x4(v[8 + q], v[12 + q], 0x88), b3 = _mm512_shuffle_f32x4(v[8 + q], v[12 + q], 0xdd);
    t[q] = _mm512_shuffle_f32x4(b0, b2, 0x88);
    t[8 + q] = _mm512_shuffle_f32x4(b0, b2, 0xdd);
    t[4 + q] = _mm512_shuffle_f32x4(b1, b3, 0x88);
    t[12 + q] = _mm512_shuffle_f32x4(b1, b3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}
