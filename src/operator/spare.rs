//! Memory a map keeps after a burst. A `HashMap` never gives back the table it grew to: the
//! per-At bookkeeping of a leader that watched 100,000 Ats being created would keep tables
//! sized for all of them after they settled. Maps that shrink call `shrink_if_sparse` after
//! removing, which gives the spare room back once three quarters of it are unused.

use std::collections::HashMap;
use std::hash::Hash;

/// Below this many slots a table is not worth shrinking.
const SMALL: usize = 1024;

/// Shrinks `map` to twice its length when it uses less than a quarter of its capacity: the
/// cost (a rehash of what is left) is paid at most once per halving of the table, so removals
/// stay amortized O(1).
pub fn shrink_if_sparse<K: Eq + Hash, V, S: std::hash::BuildHasher>(map: &mut HashMap<K, V, S>) {
    if map.capacity() > SMALL && map.len() < map.capacity() / 4 {
        map.shrink_to(map.len() * 2);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_emptied_after_a_burst_gives_its_table_back_and_a_small_or_full_one_keeps_it() {
        let mut map: HashMap<u32, u32> = (0..100_000).map(|i| (i, i)).collect();
        let grown = map.capacity();
        for i in 0..50_000 {
            map.remove(&i);
            shrink_if_sparse(&mut map);
        }
        assert_eq!(map.capacity(), grown, "half full: kept");
        for i in 50_000..99_990 {
            map.remove(&i);
            shrink_if_sparse(&mut map);
        }
        assert_eq!(map.len(), 10);
        assert!(map.capacity() <= SMALL, "{} slots left for 10", map.capacity());
        assert!((99_990..100_000).all(|i| map.get(&i) == Some(&i)), "what is left is kept");

        let mut small: HashMap<u32, u32> = (0..500).map(|i| (i, i)).collect();
        let capacity = small.capacity();
        small.retain(|&k, _| k < 2);
        shrink_if_sparse(&mut small);
        assert_eq!(small.capacity(), capacity, "small tables are left alone");
    }
}
