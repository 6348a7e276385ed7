//! Memory a map keeps after a burst: a `HashMap` never gives back the table it grew to, so
//! per-At maps call `shrink_if_sparse` after removing.

use crate::sync::lock;
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;

/// Tables for at most this many entries are not worth shrinking.
const SMALL: usize = 1024;

/// Shrinks `map`'s table to one for four times its length (at least `SMALL`) when it is larger
/// than that; removals stay amortized O(1), as `shrink_to` at least halves a table it shrinks
/// and does nothing, in constant time, unless the table would get smaller. (`capacity()` cannot
/// tell: deleted entries count against it while their slots are still allocated.)
pub fn shrink_if_sparse<K: Eq + Hash, V, S: std::hash::BuildHasher>(map: &mut HashMap<K, V, S>) {
    map.shrink_to((map.len() * 4).max(SMALL));
}

/// Removes `key`'s entry from a shared map, then `shrink_if_sparse`; returns its value.
pub fn remove<K: Eq + Hash, V>(map: &Mutex<HashMap<K, V>>, key: &K) -> Option<V> {
    let mut map = lock(map);
    let removed = map.remove(key);
    if removed.is_some() {
        shrink_if_sparse(&mut map);
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_map_emptied_after_a_burst_gives_its_table_back_and_a_small_one_keeps_it() {
        let mut map: HashMap<u32, u32> = (0..100_000).map(|i| (i, i)).collect();
        for i in 0..99_990 {
            map.remove(&i);
            shrink_if_sparse(&mut map);
        }
        assert_eq!(map.len(), 10);
        assert!(
            (SMALL..2 * SMALL).contains(&map.capacity()),
            "{} slots left for 10",
            map.capacity()
        );
        assert!(
            (99_990..100_000).all(|i| map.get(&i) == Some(&i)),
            "what is left is kept"
        );

        let mut small: HashMap<u32, u32> = (0..SMALL as u32).map(|i| (i, i)).collect();
        small.retain(|&k, _| k < 2);
        let capacity = small.capacity();
        shrink_if_sparse(&mut small);
        assert_eq!(small.capacity(), capacity, "small tables are left alone");
    }
}
