//! What the kernel tests share: a small seeded generator (xorshift), so that every run
//! draws the same cases.

pub struct Rng(pub u64);

#[allow(dead_code)] // each test file uses its own subset
impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// Uniform in [-1, 1], in steps of 1e-4.
    pub fn unit(&mut self) -> f32 {
        (self.next() % 20_001) as f32 / 10_000.0 - 1.0
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}
