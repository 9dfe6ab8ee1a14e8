//! Workload randomness drawn from the simulator's seeded generator.

/// Draws from madsim's global generator, so every choice replays from the seed and is
/// compared by `MADSIM_TEST_CHECK_DETERMINISM`. Outside madsim (unit tests of the pure
/// parts) it falls back to a fixed SplitMix64 sequence.
#[derive(Debug, Default)]
pub struct SimRng {
    #[cfg(not(madsim))]
    state: u64,
}

impl SimRng {
    /// A generator over the current simulation's seed.
    pub fn new() -> Self {
        Self::default()
    }

    /// A uniformly random `u64`.
    pub fn next_u64(&mut self) -> u64 {
        #[cfg(madsim)]
        {
            madsim::rand::random::<u64>()
        }
        #[cfg(not(madsim))]
        {
            self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = self.state;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        }
    }

    /// A number in `low..high` (`low` if the range is empty).
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        low + self.next_u64() % (high - low)
    }

    /// `true` with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.range(0, 100) < percent
    }

    /// One element of `items`.
    ///
    /// # Panics
    /// If `items` is empty.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        assert!(!items.is_empty(), "pick from an empty slice");
        &items[self.range(0, items.len() as u64) as usize]
    }
}
